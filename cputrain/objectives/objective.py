"""A run's objective, chosen once from train.objective: what one micro-batch's loss is, what the
step counts to normalise it (trained targets, pairs or examples), and the validation figures.

The trainer calls it the same way for every objective. The step's loss is the sum over the global
batch ÷ the global count of its items (trained targets for lm, pairs for dpo, simpo and reward,
examples for kto), each rank dividing by that count ÷ world size because strategies average
gradients over ranks: the loss is then the mean over the whole global batch whatever the
micro-batch size and number of ranks. Every objective answers the same questions: which head the
model needs (`head`: the language model's, or a reward model's score), whether it keeps reference
log-probabilities beside the token cache (`stores_reference`), what it computes before training
(`prepare`) and at the start of each step over the step's micro-batches (`start_step`), a
micro-batch's loss and the sums of its figures (`loss`), the figures from the global sums
(`figures`), and the validation sums (`summed`). KTO's is objectives.kto, the reward model's
objectives.reward.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from cputrain.errors import ConfigError
from cputrain.objectives.preference_loss import STAT_NAMES, dpo_losses, simpo_losses
from cputrain.objectives.sequence_sums import summed_logps

log = logging.getLogger("cputrain")

PREFERENCE_OBJECTIVES = ("dpo", "simpo")
# What each objective trains on (data.format), and what to set where it is not that.
DATA_OF = {"dpo": "preference", "simpo": "preference", "reward": "preference", "kto": "unpaired"}
# What the plans read of an objective before any run: the head it trains (model.score_head) and
# the forwards a step runs beyond its own over the same tokens (KTO: its KL sequences, no gradient).
HEAD_OF = {"reward": "score"}
EXTRA_FORWARDS = {"kto": 1}


def check_reference(train_cfg, lora: bool) -> None:
    """Refuse, in one line, a live DPO reference where there is no base to run it on."""
    if train_cfg.objective == "dpo" and train_cfg.dpo_reference == "live" and not lora:
        raise ConfigError("train.dpo_reference=live runs the base with the LoRA adapters off on every step, but "
                          "this run trains full weights (no base left to run); use train.dpo_reference=precompute "
                          "or model.lora.enabled=true")


def check_objective(objective: str, data_format: str) -> None:
    """Refuse, in one line, an objective that cannot train on this data."""
    wanted = DATA_OF.get(objective)
    if wanted == "preference" and data_format != "preference":
        raise ConfigError(f"train.objective={objective} trains on preference pairs, but data.format is {data_format}; "
                          "set data.format=preference (or auto) on records with chosen and rejected answers")
    if wanted == "unpaired" and data_format != "unpaired":
        fix = ("train.objective=dpo, simpo or reward on pairs, or take each pair apart into a desirable and an "
               "undesirable record" if data_format == "preference" else "data.format=unpaired (or auto)")
        raise ConfigError(f"train.objective=kto trains on answers each with a thumbs-up or down (prompt, completion "
                          f"and a boolean label: data.format=unpaired), but data.format is {data_format}; set {fix}")
    if objective == "lm" and data_format == "preference":
        raise ConfigError("data.format=preference holds pairs, which the language-model loss (train.objective=lm) "
                          "does not read; set train.objective=dpo or simpo (or reward, to train a reward model)")
    if objective == "lm" and data_format == "unpaired":
        raise ConfigError("data.format=unpaired holds answers with a thumbs-up or down, which the language-model loss "
                          "(train.objective=lm) does not read; set train.objective=kto")


class LmObjective:
    """The next-token loss on trained targets: what every run trained before preference objectives."""

    names: tuple[str, ...] = ()  # no figures beside the loss
    stores_reference = False
    head = "lm"

    def prepare(self, model, rows: list, micro_batch: int, autocast, store=None) -> None:
        """Before training and before any checkpoint is loaded: nothing to compute."""

    def start_step(self, model, micro_batches: list, autocast) -> None:
        """Before a step's micro-batches: nothing to compute."""

    def items(self, batch) -> int:
        return batch.trained_targets

    def loss(self, model, batch, divisor: float) -> tuple[torch.Tensor, None]:
        return model(**batch.model_inputs(), num_items_in_batch=divisor).loss, None

    def figures(self, sums, items: int) -> dict[str, float]:
        return {}

    @torch.no_grad()
    def summed(self, model, rows, indices, micro_batch: int, autocast) -> tuple[np.ndarray, int]:
        """([sum of the losses], trained targets) over rows[indices]."""
        from cputrain.objectives.validation_loss import summed_loss

        total, targets = summed_loss(model, rows, indices, micro_batch, autocast)
        return np.array([total]), targets


class PreferenceObjective:
    """DPO against a reference, or SimPO, on pairs. The reference log-probabilities are computed
    once, before training (prepare, train.dpo_reference=precompute): from the starting weights,
    with LoRA through the converter's reference (the base with the adapters off). With LoRA and
    train.dpo_reference=live, the base runs on each micro-batch instead."""

    names = STAT_NAMES
    head = "lm"

    def __init__(self, train_cfg, reference: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None,
                 chunked: bool = False):
        self.cfg, self.reference, self.chunked = train_cfg, reference, chunked
        self.kind = train_cfg.objective

    @property
    def stores_reference(self) -> bool:
        """DPO's precomputed reference is kept beside the token cache (objectives.reference_store)."""
        return self.kind == "dpo"

    def start_step(self, model, micro_batches: list, autocast) -> None:
        """Before a step's micro-batches: nothing to compute."""

    def figures(self, sums, items: int) -> dict[str, float]:
        """TRL's figures: means over the pairs."""
        return {name: float(v) / max(items, 1) for name, v in zip(self.names, sums)}

    def reference_table(self, model, split, micro_batch: int, autocast, indices=None) -> torch.Tensor:
        return reference_table(model, split, micro_batch, autocast, indices, self.chunked)

    @torch.no_grad()
    def prepare(self, model, rows: list, micro_batch: int, autocast, store=None) -> None:
        """DPO's reference log-probabilities of every sequence of `rows` (each a PairRows), from
        the weights as loaded, before any checkpoint replaces them; with LoRA inside the
        converter's reference context, so the base alone whatever the adapters hold. Read from the
        store's file where it holds them, else computed with the rows split across the ranks (a
        ReferenceStore; None: this rank alone computes all) and saved there."""
        if self.kind != "dpo" or (self.reference is not None and self.cfg.dpo_reference == "live"):
            return
        from cputrain.objectives.reference_store import ReferenceStore

        store = store or ReferenceStore(None, 0, 1, 0)
        started_s = time.perf_counter()
        pairs = sum(split.pairs for split in rows)
        model.eval()
        base = self.reference(model) if self.reference is not None else contextlib.nullcontext()
        if store.fill(rows, lambda split, indices: reference_table(model, split, micro_batch, autocast, indices,
                                                                   self.chunked), base):
            log.info("DPO reference: the log-probabilities of %d pairs read from %s", pairs, store.path)
            return
        log.info("DPO reference: the log-probabilities of %d pairs computed before training in %.1f s over %d "
                 "rank(s) (train.dpo_reference=precompute%s)%s", pairs, time.perf_counter() - started_s,
                 store.world_size, ": the base, adapters off" if self.reference is not None else ": the weights as loaded",
                 f"; kept in {store.path}" if store.path is not None else "")

    def items(self, batch) -> int:
        return batch.pairs

    def _losses(self, model, batch):
        logps, tokens = pair_logps(model, batch, self.chunked)
        cfg = self.cfg
        if self.kind == "simpo":
            means = logps / tokens.clamp(min=1)
            return simpo_losses(means[0::2], means[1::2], cfg.simpo_beta, cfg.simpo_gamma)
        if batch.reference_logps is not None:  # computed before training (full weights)
            ref = batch.reference_logps
        else:
            # The reference sees the same micro-batch through the same weights with the adapters
            # off: no second model in memory, and no gradient.
            with torch.no_grad(), self.reference(model):
                ref, _ = pair_logps(model, batch, self.chunked)
        return dpo_losses(logps[0::2], logps[1::2], ref[0::2], ref[1::2], cfg.dpo_beta, cfg.dpo_label_smoothing)

    def loss(self, model, batch, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(the pairs' summed loss ÷ divisor, the sums of TRL's figures over the pairs)."""
        pairs = self._losses(model, batch)
        return pairs.losses.sum() / divisor, pairs.stat_sums()

    def summed(self, model, rows, indices, micro_batch: int, autocast) -> tuple[np.ndarray, int]:
        """([sum of the losses, sums of TRL's figures…], pairs) over rows[indices]."""
        from cputrain.objectives.validation_loss import micro_batches, summed_figures

        return summed_figures(lambda batch: self._losses(model, batch), micro_batches(rows, indices, micro_batch),
                              autocast, lambda batch: batch.pairs, len(STAT_NAMES))


def pair_logps(model, batch, chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each sequence's trained tokens, their number) for the 2 × pairs
    sequences of `batch` (objectives.sequence_sums)."""
    return summed_logps(model, batch, chunked, 2 * batch.pairs)


@torch.no_grad()
def reference_table(model, split, micro_batch: int, autocast, indices=None, chunked: bool = False) -> torch.Tensor:
    """The log-probabilities `model` gives every sequence of `split` (a PairRows without a table),
    2k and 2k+1 for pair k; of the rows `indices` only (the others 0), when given."""
    table = torch.zeros(2 * split.pairs, dtype=torch.float32)
    indices = np.arange(len(split)) if indices is None else np.asarray(indices)
    for start in range(0, len(indices), micro_batch):
        chunk = indices[start : start + micro_batch]
        batch = split.batch(chunk)
        with autocast():
            logps, _ = pair_logps(model, batch, chunked)
        at = 0
        for row in chunk:  # the batch holds its rows' sequences in order
            first, end = 2 * split.bounds[row], 2 * split.bounds[row + 1]
            table[first:end] = logps[at : at + end - first]
            at += end - first
    return table


def objective_for(train_cfg, reference, chunked: bool = False):
    """The run's objective; `reference(model)` is the converter's context in which `model` is the
    reference; `chunked`: model.chunked_loss installed the block-wise head (kernels/chunked_loss)."""
    if train_cfg.objective in PREFERENCE_OBJECTIVES:
        return PreferenceObjective(train_cfg, reference, chunked)
    if train_cfg.objective == "kto":
        from cputrain.objectives.kto import KtoObjective

        return KtoObjective(train_cfg, reference, chunked)
    if train_cfg.objective == "reward":
        from cputrain.objectives.reward import RewardObjective

        return RewardObjective(train_cfg)
    return LmObjective()
