"""The reward functions of an online-RL run (train.objective=grpo, rloo): named in train.rewards,
built before any work (the trainer hands them to the objective), called on each step's completions.
Above `finished`: a reward may be a finished reward model, scored in process."""
