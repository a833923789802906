"""One `cputrain train` in a fresh process and a temporary run folder, measured from outside (the
process's whole-life peak RSS, its wall time) and read from what the run wrote (metrics.jsonl,
memory.json, config.yaml) before the folder goes."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.runner.processes import run_measured


@dataclass
class TrainedRun:
    metrics_rows: list[dict]  # metrics.jsonl, every row
    step_peak: dict  # memory.json: rank 0's "training step peak" phase (rss_gib and the state's bytes)
    process_peak_rss_gib: float  # the process's whole life (wait4), loading and saving included
    wall_s: float  # the process's, start to end
    config_yaml: str  # the run folder's config.yaml


def train_measured(overrides: list[str], what: str = "cputrain", prefix: str | None = None) -> TrainedRun:
    """`cputrain train output_dir=<a temporary folder> <overrides>`; a failed run raises, naming `what`."""
    with tempfile.TemporaryDirectory(prefix=prefix) as out:
        t0 = time.perf_counter()
        _, stderr, code, process_peak = run_measured([sys.executable, "-m", "cputrain", "train", f"output_dir={out}",
                                                      *overrides])
        wall_s = time.perf_counter() - t0
        if code:
            raise RuntimeError(f"{what} failed:\n{stderr[-3000:]}")
        run = Path(out)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        phases = json.loads((run / "memory.json").read_text())["ranks"][0]["phases"]
        config_yaml = (run / "config.yaml").read_text()
    step_peak = next(p for p in phases if p["phase"] == "training step peak")
    return TrainedRun(rows, step_peak, process_peak, wall_s, config_yaml)
