"""Online RL: rollouts and steps (docs/benchmarks/online-rl.md)."""
