"""Online RL's losses as TRL 1.16 defines them (GRPOTrainer, RLOOTrainer), on tensors alone: the
advantages of each prompt's group of completions, and the clipped policy-gradient loss of a
micro-batch as a sum the objective divides by the global batch's count.

Tensors are completion-aligned: [completions, tokens] where tokens are the completion's, `mask`
1 on its tokens (the stop token included) and 0 on padding. Rewards are [completions], a prompt's
`num_generations` completions side by side.

TRL takes each loss as a mean over one device's micro-batch then divides by the accumulation
steps; its DDP averages over the ranks. Over equal micro-batches that is the sum over the global
batch ÷ the global count of the loss type's items, which is what these sums are divided by
(objectives.contract): completions for grpo and rloo, completions × max_completion_length for
dr_grpo, completion tokens for dapo (TRL's own global normaliser).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# TRL's guard against a group whose rewards are all equal (std 0)
STD_EPSILON = 1e-4

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")

# The sums a micro-batch's loss returns beside it (summed over the global batch, then made means):
# tokens and completions first, so the ratios below can be taken over them.
SUM_NAMES = ("completion_tokens", "completions", "clip_low_tokens", "clip_high_tokens", "clip_region_tokens",
             "kl_tokens")


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str,
                     batch_std: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's advantages: (reward − its group's mean) ÷ (std + 1e-4), the std that of the group
    (scale_rewards=group), of the global batch (`batch_std`, batch) or none (none); and whether each
    group's std is 0 (frac_reward_zero_std), one per completion. std is unbiased, as TRL's nanstd."""
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    group_std = grouped.std(dim=1).repeat_interleave(num_generations)
    advantages = torch.where(_equal_groups(grouped), 0.0, rewards - mean)
    if scale_rewards == "group":
        advantages = advantages / (group_std + STD_EPSILON)
        std = group_std
    elif scale_rewards == "batch":
        std = torch.full_like(rewards, float(batch_std if batch_std is not None else rewards.std()))
        advantages = advantages / (std + STD_EPSILON)
    elif scale_rewards == "none":
        std = group_std
    else:
        raise ValueError(f"scale_rewards must be group, batch or none, not {scale_rewards!r}")
    return advantages, torch.isclose(std, torch.zeros_like(std))


def leave_one_out_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """RLOO's advantages: each reward minus the mean of its group's other rewards."""
    grouped = rewards.view(-1, num_generations)
    baselines = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    return torch.where(_equal_groups(grouped), 0.0, (grouped - baselines).reshape(-1))


def _equal_groups(grouped: torch.Tensor) -> torch.Tensor:
    """Per completion: whether its group's rewards are all equal, where its advantage is 0 exactly.
    Computed, it is often not: the fp32 mean of 8 equal rewards differs from them in the last bit for
    ~40% of values (a baseline left out of one: ~10%), and ÷ (std 0 + 1e-4) makes that ulp an
    advantage of ~1e-3. An exact 0 is what the math says, and what lets the step skip the
    completion (OnlineRlObjective.batches_from_completions)."""
    return (grouped == grouped[:, :1]).all(dim=1).repeat_interleave(grouped.shape[1])


def normalized(advantages: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """RLOO's normalize_advantages over the global batch (its mean and unbiased std)."""
    return (advantages - mean) / (std + STD_EPSILON)


def token_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """GRPO's per-token KL to the reference (Schulman's k3 estimator, ≥ 0)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


@dataclass
class MicroBatchLoss:
    """A micro-batch's loss summed over its items (÷ the global count makes the step's loss), and
    the sums of SUM_NAMES over it."""

    summed: torch.Tensor
    sums: torch.Tensor


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              loss_type: str, epsilon_low: float, epsilon_high: float, max_completion_length: int,
              beta: float = 0.0, ref_logps: torch.Tensor | None = None) -> MicroBatchLoss:
    """GRPOTrainer's token-level clipped loss (importance sampling per token), the KL to the
    reference added to each token's loss where beta > 0, summed as `loss_type` normalises it."""
    mask = mask.to(logps.dtype)
    advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if beta != 0.0:
        kl = token_kl(logps, ref_logps)
        per_token = per_token + beta * kl
    if loss_type == "grpo":  # each completion's mean over its tokens
        summed = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    elif loss_type in ("dapo", "dr_grpo"):  # every token; the divisor says over what
        summed = (per_token * mask).sum()
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, not {loss_type!r}")
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    return MicroBatchLoss(summed, _sums(mask, low, high, kl))


def rloo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              epsilon_low: float, epsilon_high: float) -> MicroBatchLoss:
    """RLOOTrainer's sequence-level clipped loss: the ratio of each completion's summed
    log-probability, summed over the completions (÷ their global number: the mean)."""
    mask = mask.to(logps.dtype)
    log_ratio = ((logps - old_logps) * mask).sum(1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    summed = (-torch.min(ratio * advantages, clipped * advantages)).sum()
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    # TRL's RLOO clip ratios are means over completions: count each completion once, as one "token"
    ones = torch.ones(len(ratio), 1, dtype=logps.dtype)
    return MicroBatchLoss(summed, _sums(ones, low.unsqueeze(1), high.unsqueeze(1), None, tokens=mask.sum()))


def items_of(loss_type: str, completions: int, tokens: int, max_completion_length: int) -> int:
    """What the summed loss of a batch is divided by, counted over it: completions (grpo, rloo),
    completions × max_completion_length (dr_grpo) or completion tokens (dapo)."""
    if loss_type == "dapo":
        return tokens
    if loss_type == "dr_grpo":
        return completions * max_completion_length
    return completions


def _sums(mask: torch.Tensor, low: torch.Tensor, high: torch.Tensor, kl: torch.Tensor | None,
          tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The micro-batch's SUM_NAMES: its completion tokens and completions, then the tokens (RLOO:
    completions) clipped low, high, either, and the summed KL, each over `mask`'s positions."""
    with torch.no_grad():
        counted = mask.sum()
        region = (low | high).to(mask.dtype)
        return torch.stack([
            (tokens if tokens is not None else counted).double(), torch.tensor(float(len(mask)), dtype=torch.float64),
            (low.to(mask.dtype) * mask).sum().double(), (high.to(mask.dtype) * mask).sum().double(),
            (region * mask).sum().double(),
            (kl.detach() * mask).sum().double() if kl is not None else torch.zeros((), dtype=torch.float64)])


def loss_figures(sums, sequence_level: bool, beta: float) -> dict[str, float]:
    """TRL's clip ratios (over completion tokens; RLOO: over completions) and kl (beta > 0) from the
    global SUM_NAMES sums."""
    tokens, completions, low, high, region, kl = (float(v) for v in sums)
    over = max(completions if sequence_level else tokens, 1.0)
    figures = {"clip_ratio/low_mean": low / over, "clip_ratio/high_mean": high / over,
               "clip_ratio/region_mean": region / over}
    if beta != 0.0 and not sequence_level:
        figures["kl"] = kl / max(tokens, 1.0)
    return figures
