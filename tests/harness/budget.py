"""The suite's time budget, and the machine it ran on: said in the run's header and its last lines."""

from __future__ import annotations

import pytest

# The full suite's budget on the slowest machine kind CI gets, a 2-core AVX2-only CPU (README, Tests).
BUDGET_S = 30 * 60
WARN_AFTER_S = 45 * 60  # half of CI's 90 minutes: said at the end of the run, not a failure

STARTED = pytest.StashKey[float]()  # the session's start (time.monotonic), in pytest's config stash
MATMUL_AT_START = pytest.StashKey[float]()  # matmul_gflops() when the session started

CALIBRATION_N = 2048  # ~17 GFLOP a product: ~0.1 s at the speeds seen here, best of 3


def matmul_gflops() -> float:
    """This machine's fp32 matmul speed now, every core's thread (cputrain's own timing). A shared
    VM's speed drifts (a 4096² product read 188 GFLOP/s one hour and 149–161 the next): suite times
    are comparable only beside the speed the machine had while they ran."""
    import torch

    from cputrain.metrics.measured_peak import time_matmul

    return time_matmul(CALIBRATION_N, torch.float32) / 1e9


def cpu_line() -> str:
    """The machine in one line, from cputrain's own detection (the flags `cputrain doctor` prints)."""
    from cputrain.hardware import detect

    hw = detect()
    return f"{hw.cpu_model}, {hw.physical_cores} cores, " + " ".join(
        f"{flag}={'yes' if on else 'no'}" for flag, on in hw.flags.items())


def report_wall_time(terminalreporter, elapsed_s: float, gflops_at_start: float | None = None,
                     gflops_at_end: float | None = None) -> None:
    """The suite's wall time against its budget, with the machine's matmul speed at its start and end
    where measured; past WARN_AFTER_S, a warning that names the budget."""
    speed = ("" if gflops_at_start is None or gflops_at_end is None else
             f"; fp32 matmul {CALIBRATION_N}² {gflops_at_start:.0f} GFLOP/s at the start, {gflops_at_end:.0f} at the end")
    terminalreporter.write_line(f"suite wall time: {elapsed_s:.0f} s on {cpu_line()} "
                                f"(budget: {BUDGET_S // 60} min on a 2-core AVX2-only CPU){speed}")
    if elapsed_s > WARN_AFTER_S:
        terminalreporter.write_line(
            f"warning: the suite took {elapsed_s / 60:.0f} min, past {WARN_AFTER_S // 60} of CI's 90; its budget is "
            f"{BUDGET_S // 60} min on a 2-core AVX2-only CPU (README, Tests): make the new tests cheaper", yellow=True)
