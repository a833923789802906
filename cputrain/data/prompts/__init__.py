"""Prompts alone (TRL's prompt-only records), what online RL (train.objective=grpo, rloo) samples from."""
