"""Rollouts: completions sampled from the policy being trained, batched, with a KV cache."""
