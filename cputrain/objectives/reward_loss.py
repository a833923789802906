"""The reward model's loss as a pure function of each pair's two scores, with the figures TRL's
RewardTrainer logs beside it.

The formula is TRL's (Bradley–Terry, with its optional margin and reward centering):

    loss   = -logσ(r_chosen - r_rejected - margin) + c·(r_chosen + r_rejected)²
    figures: accuracy (r_chosen > r_rejected), margin (r_chosen - r_rejected), mean_reward

`margin` is each pair's own (data.margin_field; 0 without one) and c train.center_rewards_coefficient
(none by default). Each pair's loss is returned (not their mean: the step normalises over the pairs
of the whole global batch, as TRL's mean over its batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Sums over the pairs, in this order (RewardLosses.stat_sums); ÷ pairs: TRL's figures.
STAT_NAMES = ("accuracy", "margin", "mean_reward")


@dataclass
class RewardLosses:
    losses: torch.Tensor  # one per pair
    chosen: torch.Tensor  # each pair's two rewards
    rejected: torch.Tensor

    def stat_sums(self) -> torch.Tensor:
        c, r = self.chosen.detach().float(), self.rejected.detach().float()
        return torch.stack([(c > r).float().sum(), (c - r).sum(), ((c + r) / 2).sum()]).double()


def bradley_terry_losses(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                         center_coefficient: float | None = None) -> RewardLosses:
    """The loss of each pair from its chosen and rejected answers' rewards."""
    difference = chosen - rejected - (margin if margin is not None else 0.0)
    losses = -F.logsigmoid(difference)
    if center_coefficient is not None:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return RewardLosses(losses, chosen, rejected)
