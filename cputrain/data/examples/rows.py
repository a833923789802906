"""Chat and prompt/completion examples in the token cache, and the rows the trainer takes from them.

A complete entry (cputrain.data.prepare builds it) holds, for each split:

    train.bin          token ids of every example, back to back (uint16/uint32)
    train.mask.bin     1 where the token is a trained target, else 0 (uint8, one per token)
    train.lengths.bin  tokens per example (uint32), so examples are found without a scan
    stats.json         written last: its presence marks the entry complete

The ids and the mask are memory-mapped: a rank's RSS grows with the pages it touches, not with
the corpus. The lengths and their running sum are held (12 bytes per example: 240 MB for 20M).

Packing (data.packing) puts whole examples into rows of data.seq_len in corpus order: the next
example goes into the current row if it fits, else it opens a new row (next-fit), so a row is one
contiguous run of the ids and no example is ever split. Position ids restart at each example;
transformers builds a block-diagonal causal mask from them, so no token attends to another
example. The tail of a row is padding: never a target, positions of its own. Without packing a
row is one example, and a micro-batch is padded to its longest example (right padding under a
causal mask changes nothing before it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cputrain.data.batch import IGNORE_INDEX, Batch


def pack_bounds(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Row boundaries in example indices (next-fit in order): row r holds examples [b[r], b[r+1])."""
    bounds, fill = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if fill + n > seq_len and fill:
            bounds.append(i)
            fill = 0
        fill += n
    if len(lengths):
        bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


class ExampleRows:
    def __init__(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, seq_len: int, packing: bool,
                 pad_id: int):
        self.ids, self.mask, self.lengths = ids, mask, lengths.astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.seq_len, self.packing, self.pad_id = seq_len, packing, pad_id
        self.bounds = pack_bounds(self.lengths, seq_len) if packing else np.arange(len(lengths) + 1, dtype=np.int64)

    def __len__(self) -> int:
        return max(0, len(self.bounds) - 1)

    @property
    def tokens(self) -> int:
        return int(self.offsets[-1])

    def _row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = self.bounds[r], self.bounds[r + 1]
        t0, t1 = self.offsets[a], self.offsets[b]
        ids = np.asarray(self.ids[t0:t1], dtype=np.int64)
        labels = np.where(np.asarray(self.mask[t0:t1]) > 0, ids, IGNORE_INDEX)
        # An example's first token would be predicted from the example before it: never a target.
        labels[self.offsets[a:b] - t0] = IGNORE_INDEX
        # position within its own example: restart at every example of the row
        positions = np.arange(t1 - t0) - np.repeat(self.offsets[a:b] - t0, self.lengths[a:b])
        return ids, labels, positions

    def prompt_ids(self, example: int) -> list[int]:
        """An example's tokens before its first trained one: the prompt a model is asked to answer
        (for a chat, through the assistant's header)."""
        t0, t1 = self.offsets[example], self.offsets[example + 1]
        trained = np.flatnonzero(np.asarray(self.mask[t0:t1]))
        end = t0 + (int(trained[0]) if len(trained) else t1 - t0)
        return np.asarray(self.ids[t0:end], dtype=np.int64).tolist()

    def batch(self, indices) -> Batch:
        rows = [self._row(int(r)) for r in indices]
        width = self.seq_len if self.packing else max(len(ids) for ids, _, _ in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (ids, lab, pos) in enumerate(rows):
            n = len(ids)
            input_ids[i, :n] = torch.from_numpy(ids)
            labels[i, :n] = torch.from_numpy(lab)
            positions[i, :n] = torch.from_numpy(pos)
            positions[i, n:] = torch.arange(width - n)  # the padding is a block of its own
        # One example per row starts at position 0 and runs on: the default positions say the same.
        return Batch(input_ids, labels, positions if self.packing else None)


@dataclass
class ExampleData:
    train: ExampleRows
    val: ExampleRows
    stats: dict
    folder: Path | None = None

    def rows(self, split: str) -> ExampleRows:
        """The rows of `split` ("train" or "val") the trainer and evaluation take batches from."""
        return getattr(self, split)

    def describe(self) -> str:
        s = self.stats
        how = (f"packed into {s['train_sequences']} train rows of {s['seq_len']} tokens "
               f"({s['packing_efficiency']:.1%} filled)" if s["packing"] else
               "one per row, each micro-batch padded to its longest (data.packing=false)")
        return (f"{s['format']}: {s['train_examples']} train + {s['val_examples']} validation examples, "
                f"{s['train_tokens']} train tokens of which {s['trained_token_share']:.1%} trained; {how}; "
                f"skipped {s['skipped_no_answer']} without an answer{self._other_skips()}, dropped "
                f"{s['dropped_long']} longer than data.seq_len, truncated {s['truncated']}")

    def _other_skips(self) -> str:
        """The conversations left out for their content, where there were any (caches before these
        counts have none)."""
        s = self.stats
        parts = [(s.get("skipped_non_text_parts", 0), "with a part that is not text"),
                 (s.get("skipped_tools_unsupported", 0), "with tool calls the chat template cannot write")]
        return "".join(f", {n} {what}" for n, what in parts if n)

def _stream(path: Path, dtype, n: int) -> np.ndarray:
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.empty(0, dtype=dtype)


def open_rows(folder: Path, packing: bool, rows_class, sequences_of) -> tuple:
    """(train rows, val rows, stats) of a complete entry of the examples' streams: `rows_class`
    (ExampleRows, pairs.PairRows) over each split's memory-mapped ids and mask and its lengths,
    `sequences_of(stats, split)` sequences long; the stats with packing's figures added."""
    stats = json.loads((folder / "stats.json").read_text())
    seq_len, pad_id = stats["seq_len"], stats["pad_id"]

    def rows_of(split: str):
        tokens, sequences = stats[f"{split}_tokens"], sequences_of(stats, split)
        lengths = np.fromfile(folder / f"{split}.lengths.bin", dtype=np.uint32, count=sequences) if sequences else \
            np.empty(0, dtype=np.uint32)
        return rows_class(_stream(folder / f"{split}.bin", stats["token_dtype"], tokens),
                          _stream(folder / f"{split}.mask.bin", np.uint8, tokens), lengths, seq_len, packing, pad_id)

    train, val = rows_of("train"), rows_of("val")
    rows = len(train) * seq_len
    stats = {**stats, "packing": packing, "train_sequences": len(train), "val_sequences": len(val),
             # tokens that are examples, of all the row positions packing fills (the rest is padding)
             "packing_efficiency": round(train.tokens / rows, 4) if packing and rows else None}
    return train, val, stats


def open_examples(folder: Path, packing: bool) -> ExampleData:
    train, val, stats = open_rows(folder, packing, ExampleRows, lambda stats, split: stats[f"{split}_examples"])
    return ExampleData(train, val, stats, folder)
