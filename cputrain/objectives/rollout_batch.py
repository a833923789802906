"""A micro-batch of sampled completions, as online RL trains on them: each row a prompt and one
of its completions, right-padded, positions from 0, the completion's tokens its labels; or, where
cputrain.objectives.rollout_rows decides the prompt is shared, a prompt once and several of its
completions after it, each at positions p, p+1, … as if it followed the prompt alone, seeing the
prompt and itself only (a 4D mask, cputrain.data.batch.shared_prompt_mask). Beside them what the
loss reads per completion (its advantage, the old policy's and the reference's log-probabilities
where a step needs them), each completion's row, tokens and the row positions that predict them.

Per-token tensors are completion-aligned, [completions, longest completion], as TRL's are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cputrain.data.batch import IGNORE_INDEX, Batch, attention_mask_for, shared_prompt_mask
from cputrain.kernels.chunked_logps import PickedPositions
from cputrain.model.forward_keywords import forward_takes


@dataclass
class RolloutBatch(Batch):
    completion_mask: torch.Tensor | None = None  # [completions, longest completion] 1 on a completion's tokens
    predicted_from: torch.Tensor | None = None  # [completions, longest completion] the row position whose logits predict it
    advantages: torch.Tensor | None = None  # [completions]
    rewards: torch.Tensor | None = None  # [completions] the weighted sum of the reward functions
    old_logps: torch.Tensor | None = None  # [completions, longest completion]; None: the policy's own, detached
    ref_logps: torch.Tensor | None = None  # [completions, longest completion]; None: no KL to the reference
    completion_ids: torch.Tensor | None = None  # [completions, longest completion] its tokens, 0 past its end
    completion_rows: torch.Tensor | None = None  # [completions] the row it is in

    def __post_init__(self):
        # run state saved before these fields were (num_iterations > 1): one completion a row
        if self.completion_rows is None and self.completion_mask is not None:
            self.completion_rows = torch.arange(len(self.completion_mask))
            self.completion_ids = torch.where(self.completion_mask > 0,
                                              self.labels.gather(1, self.predicted_from + 1), 0)

    @property
    def completions(self) -> int:
        return len(self.completion_mask)

    @property
    def completion_tokens(self) -> int:
        return int(self.completion_mask.sum())


def rollout_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int,
                  rows: list[list[int]] | None = None) -> RolloutBatch:
    """Rows for the model, and where each completion token is predicted. `rows`: the completions of
    each row (completions of one prompt; cputrain.objectives.rollout_rows), their prompt laid out
    once; None: one completion a row, no mask needed (transformers' causal one)."""
    rows = rows or [[i] for i in range(len(completion_ids))]
    width = max(len(prompt_ids[r[0]]) + sum(len(completion_ids[i]) for i in r) for r in rows)
    longest = max(max(len(c) for c in completion_ids), 1)
    n = len(completion_ids)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.arange(width).repeat(len(rows), 1)  # padding goes on counting: causal, it sees the row
    sequence_ids = torch.full((len(rows), width), -1, dtype=torch.long)  # the mask's: the prompt, each completion
    mask = torch.zeros((n, longest), dtype=torch.long)
    predicted_from = torch.zeros((n, longest), dtype=torch.long)
    targets = torch.zeros((n, longest), dtype=torch.long)
    row_of = torch.zeros(n, dtype=torch.long)
    for r, members in enumerate(rows):
        prompt = prompt_ids[members[0]]
        p = at = len(prompt)
        input_ids[r, :p] = torch.tensor(prompt, dtype=torch.long)
        sequence_ids[r, :p] = 0
        for k, i in enumerate(members, start=1):
            c = len(completion_ids[i])
            ids = torch.tensor(completion_ids[i], dtype=torch.long)
            input_ids[r, at : at + c] = ids
            labels[r, at : at + c] = ids
            targets[i, :c] = ids
            positions[r, at : at + c] = torch.arange(p, p + c)
            sequence_ids[r, at : at + c] = k
            mask[i, :c] = 1
            # the first token from the prompt's last position, the next from the completion's own
            predicted_from[i, :c] = torch.arange(at - 1, at - 1 + c)
            predicted_from[i, 0] = p - 1
            row_of[i] = r
            at += c
    shared = any(len(r) > 1 for r in rows)
    attention = shared_prompt_mask(sequence_ids, sequence_ids == 0, torch.zeros_like(sequence_ids)) if shared else None
    return RolloutBatch(input_ids, labels, positions, attention_mask=attention, completion_mask=mask,
                        predicted_from=predicted_from, completion_ids=targets, completion_rows=row_of)


def completion_logps(model, batch: RolloutBatch, temperature: float, chunked: bool = False) -> torch.Tensor:
    """Each completion token's log-probability under `model`, its logits divided by the sampling
    temperature as TRL does; [completions, longest completion], 0 past a completion's end.

    `chunked` (model.chunked_loss installed the block-wise head): only the positions that predict a
    completion token go through the head, a block of them at a time, and no logits of the whole
    micro-batch exist (kernels/chunked_logps.py). Otherwise the head runs on the positions from the
    first that predicts a completion token (the model's `logits_to_keep`): a prompt's positions need
    no logits, and at a small model's size the head is the largest product of the step (the demo's
    GRPO step in bf16: 0.93–1.04 s → 0.88–0.89 s, docs/benchmarks/online-rl.md)."""
    extra = {}
    if batch.attention_mask is not None:  # a shared prompt: each completion sees it and itself
        extra["attention_mask"] = attention_mask_for(batch.attention_mask, model)
    if chunked:
        targets = torch.where(batch.completion_mask > 0, batch.completion_ids, IGNORE_INDEX)
        picked = PickedPositions(batch.completion_rows, batch.predicted_from, targets, temperature)
        return model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, picked=picked,
                     **extra).token_logps
    width = batch.input_ids.shape[1]
    first = int(torch.where(batch.completion_mask > 0, batch.predicted_from, width - 1).min())
    if forward_takes(model, "logits_to_keep"):
        extra["logits_to_keep"] = width - first
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False, **extra).logits
    offset = width - logits.shape[1]  # the row position of the first logits returned
    picked = logits[batch.completion_rows[:, None], (batch.predicted_from - offset).clamp(min=0)].float()
    if temperature != 1.0:  # a division of every logit, and again in the backward, for nothing at 1
        picked = picked / temperature
    logps = torch.log_softmax(picked, dim=-1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    return logps * batch.completion_mask
