"""A Hugging Face Trainer's steps measured as cputrain measures its own: each step's end time and
peak RSS, the batches it built, the losses it logged."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable


def trainer_step_clock(on_step_end: Callable[[], None] = lambda: None):
    """A Hugging Face TrainerCallback that measures each step as cputrain's memory.json does: the
    high-water mark reset before the step and read after it. `.marks` holds each step's end time,
    `.peaks` its peak RSS in GiB; `on_step_end()` runs after both are taken."""
    from transformers import TrainerCallback

    from cputrain.metrics import memory

    class StepClock(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []
            self.peaks: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            memory.reset_peak()

        def on_step_end(self, args, state, control, **kw):
            self.peaks.append(memory.peak_rss_gib())
            self.marks.append(time.perf_counter())
            on_step_end()

    return StepClock()


def count_trainer_steps(trainer, count_batch: Callable[[dict], dict[str, int]]):
    """Instrument a Hugging Face Trainer before train(): its collator's batches counted per step
    (`count_batch(batch)` gives a batch's counts, e.g. trained tokens and padding), each step's
    end time and peak RSS (trainer_step_clock), and the logged losses. Returns (clock, per_step,
    losses): per_step[i] holds the counts of the batches built up to step i's end."""
    from transformers import TrainerCallback

    counts: Counter[str] = Counter()  # a key no batch has counted reads 0
    per_step: list[Counter[str]] = []
    losses: list[float] = []

    def close_step() -> None:
        per_step.append(counts.copy())
        counts.clear()

    collate = trainer.data_collator

    def counting(features):
        batch = collate(features)
        counts.update(count_batch(batch))
        return batch

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    clock = trainer_step_clock(close_step)
    trainer.data_collator = counting
    trainer.add_callback(clock)
    trainer.add_callback(Losses())
    return clock, per_step, losses
