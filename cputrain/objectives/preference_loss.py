"""Preference losses as pure functions of log-probabilities: DPO's sigmoid loss and SimPO's
reference-free one, with the figures TRL logs beside them.

Each takes the log-probabilities of the answers of a set of pairs (one number per sequence) and
returns the loss of each pair (not its mean: the step normalises over the pairs of the whole
global batch) and its rewards. The formulas are TRL's (DPOTrainer's loss_type="sigmoid", the
default; CPOTrainer's loss_type="simpo"):

    dpo:    margin = (πc - πr) - (refc - refr)       on summed log-probs
            loss   = -logσ(β·margin)·(1-ls) - logσ(-β·margin)·ls
            rewards = β·(π - ref)
    simpo:  Δ      = mean-per-token πc - mean-per-token πr
            loss   = -logσ(β·Δ - γ)·(1-ls) - logσ(-(β·Δ - γ))·ls
            rewards = β·(mean-per-token π)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # a label no loss reads (cputrain.data.batch's)


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor,
                   sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the log-probabilities of each sequence's trained targets, their number), one per
    sequence of the micro-batch. logits [rows, tokens, vocab]; labels and sequence_ids [rows, tokens]:
    token t predicts labels[t+1], which belongs to sequence_ids[t+1]."""
    targets = labels[:, 1:]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (targets != IGNORE_INDEX)
    return sums_by_sequence(picked, labels, sequence_ids, sequences)


def sums_by_sequence(token_logps: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor,
                     sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sequence_logps from each label's log-probability already picked: token_logps[:, t] is that
    of labels[:, t+1] (0 where it is -100), as kernels/chunked_logps gives them ([rows, tokens-1]
    or [rows, tokens], the last position unused)."""
    trained = labels[:, 1:] != IGNORE_INDEX
    picked = token_logps[:, : trained.shape[1]] * trained
    owner = sequence_ids[:, 1:].clamp(min=0).reshape(-1)  # padding carries no target: any owner adds 0
    sums = torch.zeros(sequences, dtype=torch.float32).index_add(0, owner, picked.reshape(-1))
    counts = torch.zeros(sequences, dtype=torch.float32).index_add(0, owner, trained.reshape(-1).float())
    return sums, counts


def _sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


@dataclass
class PairLosses:
    losses: torch.Tensor  # one per pair
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    chosen_logps: torch.Tensor  # the policy's, as TRL logs them (summed; simpo: mean per token)
    rejected_logps: torch.Tensor

    def stat_sums(self) -> torch.Tensor:
        """Sums over the pairs of TRL's logged figures, in STAT_NAMES order (÷ pairs: the means)."""
        c, r = self.chosen_rewards.detach(), self.rejected_rewards.detach()
        return torch.stack([c.sum(), r.sum(), (c > r).float().sum(), (c - r).sum(),
                            self.chosen_logps.detach().sum(), self.rejected_logps.detach().sum()])


STAT_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
              "logps/rejected")


def dpo_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
               beta: float, label_smoothing: float = 0.0) -> PairLosses:
    """DPO's sigmoid loss of each pair from summed log-probabilities (policy and reference)."""
    margin = (chosen - rejected) - (ref_chosen - ref_rejected)
    return PairLosses(_sigmoid_loss(beta * margin, label_smoothing), beta * (chosen - ref_chosen).detach(),
                      beta * (rejected - ref_rejected).detach(), chosen, rejected)


def simpo_losses(chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, beta: float, gamma: float,
                 label_smoothing: float = 0.0) -> PairLosses:
    """SimPO's loss of each pair from log-probabilities averaged over each answer's tokens."""
    logits = beta * (chosen_mean - rejected_mean) - gamma
    return PairLosses(_sigmoid_loss(logits, label_smoothing), beta * chosen_mean.detach(),
                      beta * rejected_mean.detach(), chosen_mean, rejected_mean)
