"""Compute paths chosen for the CPU at hand, each measured against the plain PyTorch path it
replaces (benchmarks/step_time/bf16_step.py) and checked for the same result (tests/unit/test_kernels.py)."""
