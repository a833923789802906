"""completions.jsonl: what the objective keeps of a logged step beside its row in metrics.jsonl
(online RL: the step's first prompt with each completion, its rewards and its advantage), one
JSON line per record, appended by rank 0. Other objectives keep nothing, and the file is never made."""

from __future__ import annotations

import json

from cputrain.run_folder.layout import RunFolder

NAME = "completions.jsonl"


def append_samples(run: RunFolder, step: int, samples: list[dict]) -> None:
    """`samples` of step `step`, each a line with its step; a record's values that are not JSON
    (a tensor's number, a path) are written as their text."""
    if not samples:
        return
    with run.fs.open(run.path(NAME), "a") as f:
        for sample in samples:
            f.write(json.dumps({"step": step, **sample}, ensure_ascii=False, default=str) + "\n")
