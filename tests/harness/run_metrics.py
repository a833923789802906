"""A finished run's metrics.jsonl as the tests read it: every row, or the loss of each logged step."""

from __future__ import annotations

import json
from pathlib import Path


def metrics_rows(run_dir) -> list[dict]:
    """Every row of the run's metrics.jsonl, in the order written."""
    text = (Path(run_dir) / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def losses_by_step(run_dir) -> dict[int, float]:
    """The training loss of each logged step (rows without a loss, such as validations, left out)."""
    return {r["step"]: r["loss"] for r in metrics_rows(run_dir) if "loss" in r}
