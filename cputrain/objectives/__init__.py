"""What a training step minimises over a batch's rows: the language-model loss (lm), a preference
loss (DPO, SimPO) over pairs (preference), KTO's over thumbs-up/down feedback (kto), or a reward
model's Bradley–Terry loss over pairs (reward), each beside its pure loss (…_loss); normalised over
the global batch by the trainer. contract.Objective is what the rest of cputrain may ask of one;
objective.OBJECTIVES maps train.objective to its class."""
