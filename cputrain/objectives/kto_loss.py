"""KTO's loss as pure functions of log-probabilities, with the figures TRL logs beside it.

The formulas are TRL's KTOTrainer's (loss_type="kto", the default; eq. 7 of the KTO paper), on
summed log-probabilities of each answer under the policy (π) and the reference (ref), with the KL
term z estimated from mismatched prompt/completion pairs (KL sequences):

    z        = max(0, mean over the KL sequences of (π_KL - ref_KL))      no gradient
    desirable:    loss = w_d · (1 - σ(β·((π - ref) - z)))
    undesirable:  loss = w_u · (1 - σ(β·(z - (π - ref))))
    rewards  = β·(π - ref)

Each example's loss is returned (not their mean: the step normalises over the examples of the
whole global batch, as TRL's mean over its batch). TRL averages z over one device batch (and its
ranks); the objective takes it over the whole global batch (cputrain.objectives.kto), which is the
same where the batch is one, as TRL's comparison runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Sums over the examples, in this order (FeedbackLosses.stat_sums): counts first, so the figures
# are means over each label's own examples, as TRL's.
SUM_NAMES = ("desirable", "undesirable", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl")


def kl_estimate(kl_sum: float, kl_sequences: int) -> float:
    """z: the mean of (π_KL - ref_KL) over the KL sequences, never below 0 (TRL clamps it so)."""
    return max(kl_sum / max(kl_sequences, 1), 0.0)


@dataclass
class FeedbackLosses:
    losses: torch.Tensor  # one per example, its label's weight applied
    rewards: torch.Tensor  # β·(π - ref), detached
    logps: torch.Tensor  # the policy's summed log-probabilities
    desirable: torch.Tensor  # bool per example
    kl: float

    def stat_sums(self) -> torch.Tensor:
        """Sums over the examples of what TRL logs, in SUM_NAMES order (KTOObjective.figures: the means)."""
        d = self.desirable
        r, lp = self.rewards.detach().float(), self.logps.detach().float()
        n = float(len(d))
        return torch.stack([d.float().sum(), (~d).float().sum(), r[d].sum(), r[~d].sum(), lp[d].sum(), lp[~d].sum(),
                            torch.tensor(self.kl * n)]).double()


def kto_losses(logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: float, beta: float,
               desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> FeedbackLosses:
    """KTO's loss of each example from summed log-probabilities (policy and reference)."""
    logratios = logps - ref_logps
    desirable = desirable.to(torch.bool)
    chosen = desirable_weight * (1 - torch.sigmoid(beta * (logratios - kl)))
    rejected = undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratios)))
    return FeedbackLosses(torch.where(desirable, chosen, rejected), beta * logratios.detach(), logps, desirable, kl)


def kto_figures(sums, examples: int) -> dict[str, float]:
    """TRL's figures from the sums of SUM_NAMES: each label's rewards and log-probabilities as a
    mean over that label's examples (NaN where a batch has none of it, as TRL logs none), their
    margin, and z."""
    s = dict(zip(SUM_NAMES, (float(v) for v in sums)))
    nan = float("nan")
    chosen, rejected = s["desirable"], s["undesirable"]
    out = {"rewards/chosen": s["rewards/chosen"] / chosen if chosen else nan,
           "rewards/rejected": s["rewards/rejected"] / rejected if rejected else nan,
           "logps/chosen": s["logps/chosen"] / chosen if chosen else nan,
           "logps/rejected": s["logps/rejected"] / rejected if rejected else nan}
    out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    out["kl"] = s["kl"] / max(examples, 1)
    return out
