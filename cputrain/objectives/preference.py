"""DPO (train.objective=dpo) against a reference, and SimPO (train.objective=simpo), on pairs:
TRL's losses (objectives.preference_loss) on each sequence's summed log-probability.

DPO's reference log-probabilities are computed once, before training (prepare,
train.dpo_reference=precompute): from the starting weights, with LoRA through the converter's
reference (the base with the adapters off). With LoRA and train.dpo_reference=live, the base runs
on each micro-batch instead.
"""

from __future__ import annotations

import numpy as np
import torch

from cputrain.errors import ConfigError
from cputrain.objectives.item_losses import ItemLossObjective
from cputrain.objectives.preference_loss import STAT_NAMES, dpo_losses, simpo_losses
from cputrain.objectives.reference_store import prepare_reference, reference_chunks
from cputrain.objectives.sequence_sums import summed_logps


def refuse_unless_pairs(name: str, data_format: str) -> None:
    """The objectives that train on preference pairs (DPO, SimPO, the reward model) refuse other data."""
    if data_format != "preference":
        raise ConfigError(f"train.objective={name} trains on preference pairs, but data.format is {data_format}; "
                          "set data.format=preference (or auto) on records with chosen and rejected answers")


class PairObjective(ItemLossObjective):
    """What DPO and SimPO share: pairs, TRL's figures, each sequence's summed log-probability."""

    data_format = "preference"
    names = summary_figures = STAT_NAMES

    @classmethod
    def check_data(cls, data_format: str) -> None:
        refuse_unless_pairs(cls.name, data_format)

    def items(self, batch) -> int:
        return batch.pairs


class SimpoObjective(PairObjective):
    name = "simpo"

    def losses(self, model, batch):
        logps, tokens = pair_logps(model, batch, self.chunked)
        means = logps / tokens.clamp(min=1)
        return simpo_losses(means[0::2], means[1::2], self.cfg.simpo_beta, self.cfg.simpo_gamma)


class DpoObjective(PairObjective):
    name = "dpo"
    stores_reference = True  # the precomputed reference, beside the token cache (objectives.reference_store)
    live_reference = True

    @classmethod
    def check_reference(cls, cfg) -> None:
        """Refuse, in one line, a live reference where there is no base to run it on."""
        if cfg.train.dpo_reference == "live" and not cfg.model.lora.enabled:
            raise ConfigError("train.dpo_reference=live runs the base with the LoRA adapters off on every step, but "
                              "this run trains full weights (no base left to run); use train.dpo_reference="
                              "precompute or model.lora.enabled=true")

    def reference_table(self, model, split, micro_batch: int, autocast, indices=None) -> torch.Tensor:
        return reference_table(model, split, micro_batch, autocast, indices, self.chunked)

    @torch.no_grad()
    def prepare(self, model, rows: list, micro_batch: int, autocast, store=None) -> None:
        """The reference log-probabilities of every sequence of `rows` (each a PairRows), from the
        weights as loaded, before any checkpoint replaces them; with LoRA inside the converter's
        reference context, so the base alone whatever the adapters hold. Read from the store's file
        where it holds them, else computed with the rows split across the ranks (a ReferenceStore;
        None: this rank alone computes all) and saved there."""
        if self.reference is not None and self.cfg.dpo_reference == "live":
            return
        prepare_reference(store, rows, lambda split, indices: self.reference_table(model, split, micro_batch, autocast,
                                                                                   indices),
                          model, self.reference, "DPO", f"{sum(split.pairs for split in rows)} pairs",
                          "train.dpo_reference=precompute: ")

    def losses(self, model, batch):
        logps, _ = pair_logps(model, batch, self.chunked)
        if batch.reference_logps is not None:  # computed before training (full weights)
            ref = batch.reference_logps
        else:
            # The reference sees the same micro-batch through the same weights with the adapters
            # off: no second model in memory, and no gradient.
            with torch.no_grad(), self.reference(model):
                ref, _ = pair_logps(model, batch, self.chunked)
        return dpo_losses(logps[0::2], logps[1::2], ref[0::2], ref[1::2], self.cfg.dpo_beta,
                          self.cfg.dpo_label_smoothing)


def pair_logps(model, batch, chunked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each sequence's trained tokens, their number) for the 2 × pairs
    sequences of `batch` (objectives.sequence_sums)."""
    return summed_logps(model, batch, chunked, 2 * batch.pairs)


@torch.no_grad()
def reference_table(model, split, micro_batch: int, autocast, indices=None, chunked: bool = False) -> torch.Tensor:
    """The log-probabilities `model` gives every sequence of `split` (a PairRows without a table),
    2k and 2k+1 for pair k; of the rows `indices` only (the others 0), when given."""
    table = torch.zeros(2 * split.pairs, dtype=torch.float32)
    for chunk, batch in reference_chunks(split, micro_batch, indices):
        with autocast():
            logps, _ = pair_logps(model, batch, chunked)
        at = 0
        for row in chunk:  # the batch holds its rows' sequences in order
            first, end = 2 * split.bounds[row], 2 * split.bounds[row + 1]
            table[first:end] = logps[at : at + end - first]
            at += end - first
    return table
