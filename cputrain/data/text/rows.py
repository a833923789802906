"""Packed text in the token cache: its layout, and the rows the trainer takes from it.

Documents are joined with EOS into one stream and cut into sequences of seq_len: no padding,
so "useful tokens" = all tokens. A complete cache entry is a folder

    packed/<key>/train.bin   the train stream, token ids as uint16 (uint32 for vocabularies > 65,535)
    packed/<key>/val.bin     the validation stream (whole held-out documents)
    packed/<key>/stats.json  written last, by the one writer: its presence marks the entry complete

Training memory-maps the .bin files as [n_sequences, seq_len] arrays: a 10B-token corpus costs
each rank only the pages it touches. cputrain.data.prepare builds the entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cputrain.data.batch import Batch


class TokenRows:
    """Packed text: rows of a [n, seq_len] token array (memory-mapped); every token is a label."""

    def __init__(self, sequences: np.ndarray):
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def prompt_ids(self, row: int) -> None:
        return None  # text has no prompts: a text model is sampled from a word of its own

    def batch(self, indices) -> Batch:
        tokens = torch.from_numpy(np.ascontiguousarray(self.sequences[indices], dtype=np.int64))
        return Batch(tokens, tokens)


@dataclass
class PackedData:
    train: np.ndarray  # [n_train, seq_len] token ids (memory-mapped)
    val: np.ndarray  # [n_val, seq_len]
    stats: dict  # documents, tokens, sequences, dropped tail tokens, how validation was chosen
    folder: Path | None = None

    @property
    def seq_len(self) -> int:
        return self.train.shape[1]

    def rows(self, split: str):
        """The rows of `split` ("train" or "val") the trainer and evaluation take batches from."""
        return TokenRows(getattr(self, split))

    def describe(self) -> str:
        s = self.stats
        return (f"{s['documents']} documents, {s['tokens']} tokens → {s['train_sequences']} train + "
                f"{s['val_sequences']} validation sequences of {s['seq_len']} tokens (useful tokens 100%: 0 padding, "
                f"{s['dropped_tail_tokens']} tail tokens dropped)")


def _sequences(path: Path, dtype: str, n: int, seq_len: int) -> np.ndarray:
    if n == 0:
        return np.empty((0, seq_len), dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n, seq_len))


def open_packed(folder: Path) -> PackedData:
    stats = json.loads((folder / "stats.json").read_text())
    dtype, seq_len = stats["token_dtype"], stats["seq_len"]
    return PackedData(
        _sequences(folder / "train.bin", dtype, stats["train_sequences"], seq_len),
        _sequences(folder / "val.bin", dtype, stats["val_sequences"], seq_len),
        stats,
        folder,
    )
