"""The objectives whose loss is a sum of one loss per item (a pair, an example) with sums of the
figures TRL logs beside it: DPO, SimPO, KTO and the reward model. Their step and validation run
the same way; each says only how a micro-batch's losses are taken (`losses`)."""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from cputrain.objectives.contract import Objective
from cputrain.objectives.validation_loss import micro_batches, summed_figures


class ItemLossObjective(Objective):
    @abstractmethod
    def losses(self, model, batch):
        """The micro-batch's losses: .losses (one per item) and .stat_sums() (the sums of `names`)."""

    def loss(self, model, batch, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(the items' summed loss ÷ divisor, the sums of TRL's figures over them)."""
        losses = self.losses(model, batch)
        return losses.losses.sum() / divisor, losses.stat_sums()

    def figures(self, sums, items: int) -> dict[str, float]:
        """TRL's figures: means over the items."""
        return {name: float(v) / max(items, 1) for name, v in zip(self.names, sums)}

    def summed(self, model, rows, indices, micro_batch: int, autocast) -> tuple[np.ndarray, int]:
        """([sum of the losses, sums of TRL's figures…], items) over rows[indices]."""
        return self.summed_over(model, micro_batches(rows, indices, micro_batch), autocast)

    def summed_over(self, model, batches: list, autocast) -> tuple[np.ndarray, int]:
        return summed_figures(lambda batch: self.losses(model, batch), batches, autocast, self.items, len(self.names))
