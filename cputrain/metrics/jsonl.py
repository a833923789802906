"""metrics.jsonl, the run's own record of its logged steps: the only module that reads or writes it.

One JSON object per line and per step. summary.json, loss.png and a resumed run all read it
back, so it is written whatever else `train.report_to` names.
"""

from __future__ import annotations

import json
import logging

from cputrain.run_folder.layout import RunFolder
from cputrain.metrics import finite_json

log = logging.getLogger("cputrain")

NAME = "metrics.jsonl"


class MetricsJsonl:
    def __init__(self, run: RunFolder):
        self.run = run

    def rows(self) -> list[dict]:
        return [row for row in self._lines() if row is not None]

    def _lines(self) -> list[dict | None]:
        """Every line, None where it is not a JSON row: a kill in the middle of an append leaves a
        torn last line, which must not stop the run that resumes."""
        rows = []
        for line in (self.run.read_text(NAME) or "").splitlines():
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None
                rows.append(row if isinstance(row, dict) else None)
        return rows

    def drop_after(self, step: int) -> None:
        """Rank 0, at start: forget the rows of steps after `step`, the checkpoint this session
        resumes from, and any torn line. A run killed between checkpoints logged steps that it now
        trains again; their old rows would appear twice in metrics.jsonl and skew summary.json and
        loss.png. The file is replaced whole, so a kill during this leaves the old file or the new."""
        lines = self._lines()
        by_step = {}  # one row per step; the last written wins
        for row in lines:
            if row is not None and row.get("step", 0) <= step:
                by_step[row.get("step", 0)] = row
        kept = [by_step[s] for s in sorted(by_step)]
        torn = lines.count(None)
        if len(kept) < len(lines):
            log.info("metrics.jsonl: %d row(s) after step %d dropped; those steps are trained again%s",
                     len(lines) - torn - len(kept), step, f" ({torn} torn line(s) dropped too)" if torn else "")
            self.run.replace_text("".join(finite_json.dumps(r) + "\n" for r in kept), NAME)

    def append(self, record: dict) -> None:
        with self.run.fs.open(self.run.path(NAME), "a") as f:
            f.write(finite_json.dumps(record) + "\n")
