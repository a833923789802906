"""Timing a training step, and the medians the blocks report."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def time_steps(step: Callable[[], None], steps: int, warmup: int = 2) -> dict:
    """Median seconds of `steps` timed calls after `warmup` untimed ones, and the first call's time
    (allocation, and compilation where blocks are compiled)."""
    t0 = time.perf_counter()
    step()
    first_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "first_step_s": first_s}


def median(values: list[float]) -> float:
    return statistics.median(values)


def steady_median(rates: list[float], warmup: int) -> float:
    """The median per-step rate after the first `warmup` steps (all of them if that leaves none)."""
    return statistics.median(rates[warmup:] or rates)
