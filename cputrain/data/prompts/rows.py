"""Prompts in the token cache, and the rows online RL takes them from: one prompt a row, never
packed; a row gives its prompt's ids and its record (the prompt as written and every other column,
handed to the reward functions as TRL hands them)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cputrain.data.sequences import SequenceData, SequenceRows, open_rows


@dataclass
class PromptRecord:
    ids: list[int]
    prompt: object  # a string, or a list of messages
    columns: dict = field(default_factory=dict)  # the record's other columns (e.g. answer)


class PromptRows(SequenceRows):
    def __init__(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, seq_len: int, packing: bool,
                 pad_id: int):
        super().__init__(ids, mask, lengths, seq_len, False, pad_id)
        self.bounds = np.arange(len(lengths) + 1, dtype=np.int64)
        self.columns: np.ndarray = np.empty(0, dtype=np.uint8)  # set by open_prompts
        self.column_offsets = np.zeros(1, dtype=np.int64)

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def longest_prompt(self) -> tuple[int, int]:
        """(its tokens, its row) of the longest prompt; (0, -1) without any."""
        if not len(self.lengths):
            return 0, -1
        row = int(np.argmax(self.lengths))
        return int(self.lengths[row]), row

    def prompt_ids(self, row: int) -> list[int]:
        t0, t1 = self.offsets[row], self.offsets[row + 1]
        return np.asarray(self.ids[t0:t1], dtype=np.int64).tolist()

    def record(self, row: int) -> dict:
        c0, c1 = self.column_offsets[row], self.column_offsets[row + 1]
        return json.loads(bytes(self.columns[c0:c1]).decode())

    def prompt_records(self, indices) -> list[PromptRecord]:
        out = []
        for r in np.asarray(indices, dtype=np.int64).tolist():
            record = self.record(r)
            prompt = record.pop("prompt")
            out.append(PromptRecord(self.prompt_ids(r), prompt, record))
        return out

    def batch(self, indices):
        raise TypeError("prompt rows hold no completions to train on: train.objective=grpo or rloo samples them")


@dataclass
class PromptData(SequenceData):
    def describe(self) -> str:
        s = self.stats
        return (f"prompts: {s['train_prompts']} train + {s['val_prompts']} validation, {s['train_tokens']} train "
                f"tokens; skipped {s['skipped_empty']} empty, dropped {s['dropped_long']} longer than data.seq_len")


def open_prompts(folder: Path) -> PromptData:
    train, val, stats = open_rows(folder, False, PromptRows, lambda stats, split: stats[f"{split}_prompts"])
    for split, rows in (("train", train), ("val", val)):
        n = len(rows.lengths)
        if n:
            lengths = np.fromfile(folder / f"{split}.columns_lengths.bin", dtype=np.uint32, count=n).astype(np.int64)
            rows.column_offsets = np.concatenate([[0], np.cumsum(lengths)])
            rows.columns = np.fromfile(folder / f"{split}.columns.bin", dtype=np.uint8,
                                       count=int(rows.column_offsets[-1]))
    return PromptData(train, val, stats, folder)
