"""What a training step minimises over a batch's rows: the language-model loss, or a preference
loss (DPO, SimPO) over pairs; normalised over the global batch by the trainer."""
