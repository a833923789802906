"""Validation loss: one loop over rows of packed text or examples, for the trainer's evaluation
(each rank its share, then summed over ranks) and for `cputrain eval` on a finished model; and
the loop of the objectives with figures (DPO, SimPO, KTO, the reward model), their losses' and
figures' sums over micro-batches (`summed_figures`).

The loss is per trained target: the sum of the losses of every target that carries a label ÷
their number. Packed text has seq_len - 1 targets in every row, so this is also the mean of the
rows' means; examples have as many as their answers, packed or padded alike.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from cputrain.errors import DataError


@torch.no_grad()
def summed_loss(model, rows, indices, micro_batch: int, autocast=contextlib.nullcontext) -> tuple[float, int]:
    """(sum of the losses of the trained targets, their number) over `rows[indices]`, `micro_batch`
    rows at a time; `autocast()` is entered around each forward."""
    total, targets = 0.0, 0
    indices = np.asarray(indices)
    for start in range(0, len(indices), micro_batch):
        batch = rows.batch(indices[start : start + micro_batch])
        with autocast():
            # num_items_in_batch=1: the loss comes back as a sum over the targets, not a mean
            total += float(model(**batch.model_inputs(), num_items_in_batch=1).loss)
        targets += batch.trained_targets
    return total, targets


def evaluate_loss(model, rows, max_rows: int, micro_batch: int) -> dict:
    """Loss per trained target and perplexity over the first `max_rows` rows."""
    n = min(len(rows), max_rows)
    if n == 0:
        raise DataError("the dataset has no sequence to evaluate; use more text, a shorter data.seq_len or --split train")
    total, targets = summed_loss(model, rows, np.arange(n), micro_batch)
    loss = total / max(targets, 1)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50)), "sequences": n, "trained_targets": targets}


def micro_batches(rows, indices, micro_batch: int) -> list:
    """rows[indices] as the micro-batches of `micro_batch` rows that evaluation takes."""
    indices = np.asarray(indices)
    return [rows.batch(indices[start : start + micro_batch]) for start in range(0, len(indices), micro_batch)]


@torch.no_grad()
def summed_figures(losses_of, batches: list, autocast, items_of, figures: int) -> tuple[np.ndarray, int]:
    """([sum of the losses, sums of the `figures` figures…], items) over `batches`: `losses_of(batch)`
    gives an objective's losses (.losses, one per item, and .stat_sums()), `items_of(batch)` its items."""
    total, items = np.zeros(1 + figures), 0
    for batch in batches:
        with autocast():
            losses = losses_of(batch)
        total += np.concatenate([[float(losses.losses.sum())], losses.stat_sums().double().numpy()])
        items += items_of(batch)
    return total, items
