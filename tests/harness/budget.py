"""The suite's time budget, and the machine it ran on: said in the run's header and its last lines."""

from __future__ import annotations

import pytest

# The full suite's budget on the slowest machine kind CI gets, a 2-core AVX2-only CPU (README, Tests).
BUDGET_S = 30 * 60
WARN_AFTER_S = 45 * 60  # half of CI's 90 minutes: said at the end of the run, not a failure

STARTED = pytest.StashKey[float]()  # the session's start (time.monotonic), in pytest's config stash


def cpu_line() -> str:
    """The machine in one line, from cputrain's own detection (the flags `cputrain doctor` prints)."""
    from cputrain.hardware import detect

    hw = detect()
    return f"{hw.cpu_model}, {hw.physical_cores} cores, " + " ".join(
        f"{flag}={'yes' if on else 'no'}" for flag, on in hw.flags.items())


def report_wall_time(terminalreporter, elapsed_s: float) -> None:
    """The suite's wall time against its budget; past WARN_AFTER_S, a warning that names the budget."""
    terminalreporter.write_line(f"suite wall time: {elapsed_s:.0f} s on {cpu_line()} "
                                f"(budget: {BUDGET_S // 60} min on a 2-core AVX2-only CPU)")
    if elapsed_s > WARN_AFTER_S:
        terminalreporter.write_line(
            f"warning: the suite took {elapsed_s / 60:.0f} min, past {WARN_AFTER_S // 60} of CI's 90; its budget is "
            f"{BUDGET_S // 60} min on a 2-core AVX2-only CPU (README, Tests): make the new tests cheaper", yellow=True)
