"""Timing a training step, and running a measurement in a fresh Python process: what every
step benchmark here does the same way."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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


def run_child(script: str, *args: str) -> dict:
    """Run `script --child ARGS...` in a fresh interpreter; its last stdout line is a JSON dict."""
    from benchmarks.vs_hf_trainer import env

    proc = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True, env=env(), cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
