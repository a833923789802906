"""Validation loss: one loop over packed sequences, for the trainer's evaluation (each rank its
share, then averaged over ranks) and for `cputrain eval` on a finished model."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from cputrain.errors import DataError


@torch.no_grad()
def summed_loss(model, sequences, micro_batch: int, autocast=contextlib.nullcontext) -> tuple[float, int]:
    """(sum over sequences of each one's mean next-token loss, number of sequences) for packed
    `sequences` [n, seq_len], `micro_batch` at a time; `autocast()` is entered around each forward."""
    total, count = 0.0, 0
    for start in range(0, len(sequences), micro_batch):
        tokens = torch.from_numpy(np.ascontiguousarray(sequences[start : start + micro_batch], dtype=np.int64))
        with autocast():
            # labels=input ids: the model shifts them to predict each next token.
            total += float(model(input_ids=tokens, labels=tokens).loss) * len(tokens)
        count += len(tokens)
    return total, count


def evaluate_loss(model, sequences, micro_batch: int) -> dict:
    """Mean next-token loss and perplexity over packed `sequences` [n, seq_len]."""
    if len(sequences) == 0:
        raise DataError("the dataset has no sequence to evaluate; use more text, a shorter data.seq_len or --split train")
    total, count = summed_loss(model, sequences, micro_batch)
    loss = total / max(count, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50)), "sequences": count}
