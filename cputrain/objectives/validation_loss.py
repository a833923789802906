"""Validation loss: one loop over rows of packed text or examples, for the trainer's evaluation
(`validation_over_ranks`: each rank its share of any objective's rows, then summed over ranks)
and for `cputrain eval` on a finished model; and the loop of the objectives with figures (DPO,
SimPO, KTO, the reward model), their losses' and figures' sums over micro-batches (`summed_figures`).

The loss is per trained target: the sum of the losses of every target that carries a label ÷
their number. Packed text has seq_len - 1 targets in every row, so this is also the mean of the
rows' means; examples have as many as their answers, packed or padded alike.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from cputrain.config import TrainConfig
from cputrain.distributed import process_group as pg
from cputrain.distributed.env import RankEnv
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
            total += float(model(**batch.model_inputs(model), num_items_in_batch=1).loss)
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


def validation_over_ranks(objective, model, rows, train: TrainConfig, ranks: RankEnv, autocast) -> tuple[float, dict]:
    """The trainer's validation: the mean loss per item of `objective` (trained target, or pair)
    over the first train.eval_batches × micro-batch rows of every rank, split across ranks, and
    the objective's figures there (eval_rewards/…); the same on every rank."""
    if len(rows) == 0:
        return float("nan"), {}
    model.eval()
    mbs, world, rank = train.micro_batch_size, ranks.world_size, ranks.rank
    n = min(len(rows), train.eval_batches * mbs * world)
    n -= n % world  # every rank runs the same number of forwards (collectives must match)
    if n == 0:
        n = len(rows)
    per_rank = np.array_split(np.arange(n), world)[rank] if n >= world else np.arange(n)
    sums, items = objective.summed(model, rows, per_rank, mbs, autocast)
    *sums, items = pg.all_reduce_sum([*sums.tolist(), items])
    figures = {f"eval_{name}": v for name, v in objective.figures(sums[1:], items).items()}
    return sums[0] / max(items, 1), figures
