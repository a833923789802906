"""A micro-batch of sampled completions, as online RL trains on them: each row one prompt and one
of its completions, right-padded, positions from 0, the completion's tokens its labels; beside
them what the loss reads per completion (its advantage, the old policy's and the reference's
log-probabilities where a step needs them) and each completion token's place in the row.

Per-token tensors are completion-aligned, [completions, longest completion], as TRL's are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cputrain.data.batch import IGNORE_INDEX, Batch
from cputrain.model.forward_keywords import forward_takes


@dataclass
class RolloutBatch(Batch):
    completion_mask: torch.Tensor | None = None  # [completions, longest completion] 1 on a completion's tokens
    predicted_from: torch.Tensor | None = None  # [completions, longest completion] the row position whose logits predict it
    advantages: torch.Tensor | None = None  # [completions]
    rewards: torch.Tensor | None = None  # [completions] the weighted sum of the reward functions
    old_logps: torch.Tensor | None = None  # [completions, longest completion]; None: the policy's own, detached
    ref_logps: torch.Tensor | None = None  # [completions, longest completion]; None: no KL to the reference

    @property
    def completions(self) -> int:
        return len(self.completion_mask)

    @property
    def completion_tokens(self) -> int:
        return int(self.completion_mask.sum())


def rollout_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int) -> RolloutBatch:
    """Rows of prompt + completion for the model, and where each completion token is predicted."""
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    longest = max(max(len(c) for c in completion_ids), 1)
    rows = len(prompt_ids)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.arange(width).repeat(rows, 1)
    mask = torch.zeros((rows, longest), dtype=torch.long)
    predicted_from = torch.zeros((rows, longest), dtype=torch.long)
    for r, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        p, c = len(prompt), len(completion)
        input_ids[r, : p + c] = torch.tensor(prompt + completion, dtype=torch.long)
        labels[r, p : p + c] = torch.tensor(completion, dtype=torch.long)
        mask[r, :c] = 1
        predicted_from[r, :c] = torch.arange(p - 1, p - 1 + c)
    return RolloutBatch(input_ids, labels, positions, completion_mask=mask, predicted_from=predicted_from)


def completion_logps(model, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """Each completion token's log-probability under `model`, its logits divided by the sampling
    temperature as TRL does; [completions, longest completion], 0 past a completion's end.

    The head runs on the positions from the first that predicts a completion token (the model's
    `logits_to_keep`): a prompt's positions need no logits, and at a small model's size the head
    is the largest product of the step (the demo's GRPO step in bf16: 0.93–1.04 s → 0.88–0.89 s,
    docs/benchmarks/online-rl.md)."""
    width = batch.input_ids.shape[1]
    first = int(torch.where(batch.completion_mask > 0, batch.predicted_from, width - 1).min())
    kept = {"logits_to_keep": width - first} if forward_takes(model, "logits_to_keep") else {}
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **kept).logits
    offset = width - logits.shape[1]  # the row position of the first logits returned
    index = (batch.predicted_from - offset).clamp(min=0).unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    picked = torch.gather(logits, 1, index).float()
    if temperature != 1.0:  # a division of every logit, and again in the backward, for nothing at 1
        picked = picked / temperature
    targets = torch.where(batch.completion_mask > 0, batch.labels.gather(1, batch.predicted_from + 1), 0)
    logps = torch.log_softmax(picked, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logps * batch.completion_mask
