"""train.profile_step for the loop: one object the loop steps through every step, which records
the one step asked for under torch.profiler (metrics.step_profile.StepProfile) and writes it once
the step's row is out, keeping the seconds the profiler costs outside the step out of the
throughput window. Rank 0 only: the profiler's cost is one rank's."""

from __future__ import annotations

import contextlib
import logging

from cputrain.config import TrainConfig
from cputrain.errors import ConfigError, one_line
from cputrain.metrics.run_metrics import RunMetrics
from cputrain.metrics.step_profile import StepProfile
from cputrain.run_folder.layout import RunFolder

log = logging.getLogger("cputrain")


def check_profile_step(train: TrainConfig, last_step: int, train_sequences: int) -> None:
    """With train.epochs, the run's last step is known once the data is (with max_steps the
    config refused a later profile_step): refused here, before any weight is loaded."""
    if train.profile_step is not None and train.profile_step > last_step:
        raise ConfigError(f"train.profile_step ({train.profile_step}) is past the run's last step ({last_step}: "
                          f"train.epochs={train.epochs:g} of {train_sequences} sequences); choose a step from 1 to "
                          f"{last_step}")


def profile_step_of_session(train: TrainConfig, is_main: bool, resumed_at: int, stop_at: int) -> int | None:
    """train.profile_step if this session trains it and this is rank 0 (the others never run the
    profiler); else None, said once if the step is not in this session."""
    step = train.profile_step
    if step is None or not is_main:
        return None
    if resumed_at < step <= stop_at:
        return step
    why = (f"it was trained before this session, which resumes at step {resumed_at}" if step <= resumed_at
           else f"this session stops at step {stop_at} (train.stop_at_step)")
    log.info("train.profile_step=%d: not profiled, %s", step, why)
    return None


class StepProfiling:
    """`with profiling.recording(n):` around step n's work, `profiling.step()` once its row is
    published; both do nothing but for the profiled step."""

    def __init__(self, run: RunFolder, metrics: RunMetrics, profile_step: int | None):
        self.run, self.metrics, self.profile_step = run, metrics, profile_step
        self._profile: StepProfile | None = None  # the step recorded and not yet written

    @contextlib.contextmanager
    def recording(self, step: int):
        if step != self.profile_step:
            yield
            return
        profile = StepProfile(self.run, step)
        with profile.recording():
            yield
        self.metrics.exclude_s(profile.outside_step_s)  # starting and stopping the profiler
        self._profile = profile

    def step(self) -> None:
        """The step's row is out: write its profile, if it was recorded."""
        profile, self._profile = self._profile, None
        if profile is None:
            return
        try:
            log.info(profile.write())
        except Exception as exc:  # a profile is an aid: its failure must not end the run
            log.warning("train.profile_step: the profile of step %d was not written: %s", profile.step, one_line(exc))
        self.metrics.exclude_s(profile.write_s)
