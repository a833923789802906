"""What a training step minimises over a batch's rows: the language-model loss, a preference loss
(DPO, SimPO) over pairs, KTO's over unpaired feedback, or a reward model's Bradley–Terry loss over
pairs; normalised over the global batch by the trainer."""
