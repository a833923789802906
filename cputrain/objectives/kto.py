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

import logging

import numpy as np
import torch

from cputrain.distributed import process_group as pg
from cputrain.errors import ConfigError
from cputrain.objectives.item_losses import ItemLossObjective
from cputrain.objectives.kto_loss import SUM_NAMES, kl_estimate, kto_figures, kto_losses
from cputrain.objectives.reference_store import prepare_reference, reference_chunks
from cputrain.objectives.sequence_sums import summed_logps
from cputrain.objectives.validation_loss import micro_batches

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


class KtoObjective(ItemLossObjective):
    """KTO's loss on labelled answers; the reference's log-probabilities of every example and KL
    sequence are computed before training (prepare) and carried by each batch."""

    name = "kto"
    data_format = "feedback"
    extra_forwards = 1  # the policy's no-grad pass over the step's KL sequences (start_step)
    stores_reference = True  # kept beside the token cache (objectives.reference_store)
    items_key = "examples"
    item_described = "feedback example"
    names = SUM_NAMES
    summary_figures = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")

    def __init__(self, train_cfg=None, reference=None, chunked: bool = False):
        super().__init__(train_cfg, reference, chunked)
        self.kl = 0.0  # z of the step being taken (start_step)

    @classmethod
    def check_data(cls, data_format: str) -> None:
        if data_format != "feedback":
            fix = ("train.objective=dpo, simpo or reward on pairs, or take each pair apart into a desirable and an "
                   "undesirable record" if data_format == "preference" else "data.format=feedback (or auto)")
            raise ConfigError(f"train.objective=kto trains on answers each with a thumbs-up or down (prompt, "
                              f"completion and a boolean label: data.format=feedback), but data.format is "
                              f"{data_format}; set {fix}")

    @torch.no_grad()
    def prepare(self, model, rows: list, micro_batch: int, autocast, store=None) -> None:
        """TRL's warning on unbalanced labels; the reference's log-probabilities of every example and
        KL sequence of `rows` (each a FeedbackRows), from the weights as loaded (LoRA: inside the
        converter's reference, the base alone), before any checkpoint replaces them. Read from the
        store's file where it holds them, else computed with the rows split across the ranks."""
        cfg, train = self.cfg, rows[0]
        advice = weights_advice(int(train.labels.sum()), int(train.examples - train.labels.sum()),
                                cfg.kto_desirable_weight, cfg.kto_undesirable_weight)
        if advice is not None:
            log.warning("KTO: %s", advice)
        prepare_reference(store, rows, lambda split, indices: self.reference_table(model, split, micro_batch, autocast,
                                                                                   indices),
                          model, self.reference, "KTO",
                          f"{sum(split.examples for split in rows)} examples and their KL sequences")

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

    def losses(self, model, batch):
        logps, _ = summed_logps(model, batch, self.chunked, batch.examples)
        cfg = self.cfg
        return kto_losses(logps, batch.reference_logps, batch.desirable, self.kl, cfg.kto_beta,
                          cfg.kto_desirable_weight, cfg.kto_undesirable_weight)

    def figures(self, sums, items: int) -> dict[str, float]:
        return kto_figures(sums, items)

    def summed(self, model, rows, indices, micro_batch: int, autocast) -> tuple[np.ndarray, int]:
        """([sum of the losses, sums of TRL's figures…], examples) over rows[indices], z taken over
        all of them (and every rank's share, evaluated alike)."""
        batches = micro_batches(rows, indices, micro_batch)
        self.kl = self._kl(model, batches, autocast)
        return self.summed_over(model, batches, autocast)

    def reference_table(self, model, split, micro_batch: int, autocast, indices=None) -> torch.Tensor:
        return feedback_reference_table(model, split, micro_batch, autocast, indices, self.chunked)


@torch.no_grad()
def feedback_reference_table(model, split, micro_batch: int, autocast, indices=None,
                             chunked: bool = False) -> torch.Tensor:
    """The log-probabilities `model` gives every example of `split` (a FeedbackRows without a
    table) at 2e and its KL sequence at 2e+1; of the rows `indices` only (the others 0), when given."""
    table = torch.zeros(split.reference_sequences, dtype=torch.float32)
    for chunk, batch in reference_chunks(split, micro_batch, indices):
        with autocast():
            logps, _ = summed_logps(model, batch, chunked, batch.examples)
            kl_logps, _ = summed_logps(model, batch.kl, chunked, batch.examples)
        examples = torch.from_numpy(np.concatenate([np.arange(split.bounds[r], split.bounds[r + 1]) for r in chunk]))
        table[2 * examples] = logps.float()
        table[2 * examples + 1] = kl_logps.float()
    return table
