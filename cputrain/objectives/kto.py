"""KTO (train.objective=kto) on unpaired feedback: TRL's KTOTrainer loss against a reference
computed once before training (the starting weights; with LoRA the base, adapters off), and the
KL estimate from each example's KL sequence (cputrain.data.feedback.rows: its prompt with its
neighbour's answer).

A step first runs the policy, without gradients, on the KL sequences of every micro-batch of its
global batch, on every rank, and one all-reduce makes z, the KL estimate (objectives.kto_loss);
then each micro-batch's loss is taken against it. The estimate is then the same however the
global batch is cut into micro-batches and ranks, as the loss is: 2 ranks train as 1. TRL takes it
per device batch (averaged over the ranks of one micro-step): with one batch, as its comparison
runs, the same number. The forwards are those TRL runs (one no-grad pass over the KL sequences a
batch); only their order moves.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from cputrain.distributed import process_group as pg
from cputrain.objectives.kto_loss import SUM_NAMES, kl_estimate, kto_figures, kto_losses
from cputrain.objectives.sequence_sums import summed_logps
from cputrain.objectives.validation_loss import micro_batches, summed_figures

log = logging.getLogger("cputrain")


def weights_advice(desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL's warning where the labels are unbalanced and neither weight is in the range the KTO
    paper recommends (eq. 8: desirable_weight·desirable ÷ (undesirable_weight·undesirable) in
    [1, 4/3]); None where they are balanced or a weight fits. TRL's bounds, rounded as TRL does."""
    desirable, undesirable = max(desirable, 1), max(undesirable, 1)
    if desirable == undesirable:
        return None
    d_low = round(undesirable * undesirable_weight / desirable, 2)
    d_high = round(undesirable * undesirable_weight / desirable * 1.33, 2)
    u_low = round(desirable * desirable_weight / undesirable / 1.33, 2)
    u_high = round(desirable * desirable_weight / undesirable, 2)
    if d_low <= desirable_weight <= d_high or u_low <= undesirable_weight <= u_high:
        return None
    return (f"the training data has {desirable} desirable and {undesirable} undesirable examples, and the weights "
            f"on their losses are not in the range the KTO paper recommends for them: set EITHER "
            f"train.kto_desirable_weight in [{d_low}, {d_high}] OR train.kto_undesirable_weight in "
            f"[{u_low}, {u_high}] (not both)")


class KtoObjective:
    """KTO's loss on labelled answers; the reference's log-probabilities of every example and KL
    sequence are computed before training (prepare) and carried by each batch."""

    names = SUM_NAMES
    stores_reference = True  # kept beside the token cache (objectives.reference_store)
    head = "lm"

    def __init__(self, train_cfg, reference: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None,
                 chunked: bool = False):
        self.cfg, self.reference, self.chunked = train_cfg, reference, chunked
        self.kl = 0.0  # z of the step being taken (start_step)

    @torch.no_grad()
    def prepare(self, model, rows: list, micro_batch: int, autocast, store=None) -> None:
        """TRL's warning on unbalanced labels; the reference's log-probabilities of every example and
        KL sequence of `rows` (each a FeedbackRows), from the weights as loaded (LoRA: inside the
        converter's reference, the base alone), before any checkpoint replaces them. Read from the
        store's file where it holds them, else computed with the rows split across the ranks."""
        from cputrain.objectives.reference_store import ReferenceStore

        cfg, train = self.cfg, rows[0]
        advice = weights_advice(int(train.labels.sum()), int(train.examples - train.labels.sum()),
                                cfg.kto_desirable_weight, cfg.kto_undesirable_weight)
        if advice is not None:
            log.warning("KTO: %s", advice)
        store = store or ReferenceStore(None, 0, 1, 0)
        started_s = time.perf_counter()
        examples = sum(split.examples for split in rows)
        model.eval()
        base = self.reference(model) if self.reference is not None else contextlib.nullcontext()
        if store.fill(rows, lambda split, indices: feedback_reference_table(model, split, micro_batch, autocast,
                                                                            indices, self.chunked), base):
            log.info("KTO reference: the log-probabilities of %d examples and their KL sequences read from %s",
                     examples, store.path)
            return
        log.info("KTO reference: the log-probabilities of %d examples and their KL sequences computed before "
                 "training in %.1f s over %d rank(s) (%s)%s", examples, time.perf_counter() - started_s,
                 store.world_size, "the base, adapters off" if self.reference is not None else "the weights as loaded",
                 f"; kept in {store.path}" if store.path is not None else "")

    def start_step(self, model, micro_batches: list, autocast) -> None:
        """z for this step: the policy's KL sequences of every micro-batch, on every rank, without gradients."""
        self.kl = self._kl(model, micro_batches, autocast)

    @torch.no_grad()
    def _kl(self, model, batches: list, autocast) -> float:
        total, count = 0.0, 0
        with autocast():
            for batch in batches:
                logps, _ = summed_logps(model, batch.kl, self.chunked, batch.examples)
                total += float((logps - batch.kl.reference_logps).sum())
                count += batch.examples
        total, count = pg.all_reduce_sum([total, float(count)])
        return kl_estimate(total, int(count))

    def items(self, batch) -> int:
        return batch.examples

    def _losses(self, model, batch):
        logps, _ = summed_logps(model, batch, self.chunked, batch.examples)
        cfg = self.cfg
        return kto_losses(logps, batch.reference_logps, batch.desirable, self.kl, cfg.kto_beta,
                          cfg.kto_desirable_weight, cfg.kto_undesirable_weight)

    def loss(self, model, batch, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(the examples' summed loss ÷ divisor, the sums of TRL's figures over them)."""
        losses = self._losses(model, batch)
        return losses.losses.sum() / divisor, losses.stat_sums()

    def figures(self, sums, items: int) -> dict[str, float]:
        return kto_figures(sums, items)

    def summed(self, model, rows, indices, micro_batch: int, autocast) -> tuple[np.ndarray, int]:
        """([sum of the losses, sums of TRL's figures…], examples) over rows[indices], z taken over
        all of them (and every rank's share, evaluated alike)."""
        batches = micro_batches(rows, indices, micro_batch)
        self.kl = self._kl(model, batches, autocast)
        return summed_figures(lambda batch: self._losses(model, batch), batches, autocast,
                              lambda batch: batch.examples, len(SUM_NAMES))

    def reference_table(self, model, split, micro_batch: int, autocast, indices=None) -> torch.Tensor:
        return feedback_reference_table(model, split, micro_batch, autocast, indices, self.chunked)


@torch.no_grad()
def feedback_reference_table(model, split, micro_batch: int, autocast, indices=None,
                             chunked: bool = False) -> torch.Tensor:
    """The log-probabilities `model` gives every example of `split` (a FeedbackRows without a
    table) at 2e and its KL sequence at 2e+1; of the rows `indices` only (the others 0), when given."""
    table = torch.zeros(split.reference_sequences, dtype=torch.float32)
    indices = np.arange(len(split)) if indices is None else np.asarray(indices)
    for start in range(0, len(indices), micro_batch):
        chunk = indices[start : start + micro_batch]
        batch = split.batch(chunk)
        with autocast():
            logps, _ = summed_logps(model, batch, chunked, batch.examples)
            kl_logps, _ = summed_logps(model, batch.kl, chunked, batch.examples)
        examples = torch.from_numpy(np.concatenate([np.arange(split.bounds[r], split.bounds[r + 1]) for r in chunk]))
        table[2 * examples] = logps.float()
        table[2 * examples + 1] = kl_logps.float()
    return table
