"""How the steps ended, in summary.json: the run's metrics with status, reason and exit code,
written by rank 0 however the steps end (finished, stopped, diverged, interrupted, failed), for a
pipeline to read."""

from __future__ import annotations

import logging

from cputrain.errors import Diverged, Stopped, one_line
from cputrain.metrics.run_metrics import RunMetrics
from cputrain.metrics.summary import write_summary
from cputrain.run_folder.layout import RunFolder

log = logging.getLogger("cputrain")


def ending_summary(metrics: RunMetrics, step: int, skipped_steps: int, status: str, exit_code: int,
                   reason: str | None) -> dict:
    """The run's figures at `step`, with how it ended; skipped_steps: the non-finite steps of this
    session that updated nothing (train.max_bad_steps)."""
    summary = metrics.summary(step)
    summary.update(skipped_steps=skipped_steps, status=status, exit_code=exit_code, reason=reason)
    return summary


def status_of(err: BaseException) -> tuple[str, int]:
    """(status, exit code) of steps ended by `err`."""
    if isinstance(err, Stopped):
        status = "stopped"
    elif isinstance(err, Diverged):
        status = "diverged"
    elif isinstance(err, KeyboardInterrupt):
        status = "interrupted"
    else:
        status = "failed"
    return status, getattr(err, "exit_code", 130 if isinstance(err, KeyboardInterrupt) else 1)


def write_ended(run: RunFolder, metrics: RunMetrics, step: int, skipped_steps: int, err: BaseException) -> None:
    """Rank 0: summary.json of a run that did not finish, the figures so far and why it ended;
    then the TrainJob's progress ends with the same status."""
    status, exit_code = status_of(err)
    try:
        metrics.stop()
        write_summary(run, ending_summary(metrics, step, skipped_steps, status, exit_code, one_line(err)))
    except Exception as exc:  # the ending's own error is what the user must see
        log.warning("summary.json was not written (%s)", one_line(exc))
    metrics.end_progress(step, status)
