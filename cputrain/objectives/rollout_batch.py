"""A micro-batch of sampled completions, as online RL trains on them: each row a prompt and one
of its completions, right-padded, positions from 0, the completion's tokens its labels; or, where
cputrain.objectives.rollout_rows decides the prompt is shared, a prompt once and several of its
completions after it, each at positions p, p+1, … as if it followed the prompt alone, seeing the
prompt and itself only: attended a completion at a time (cputrain.kernels.shared_prompt_attention),
or under another attention kernel through the row's 4D mask (cputrain.data.batch.shared_prompt_mask,
RolloutBatch.row_mask). Beside them what the
loss reads per completion (its advantage, the old policy's and the reference's log-probabilities
where a step needs them), each completion's row, tokens and the row positions that predict them.

Per-token tensors are completion-aligned, [completions, longest completion], as TRL's are.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from cputrain.data.batch import IGNORE_INDEX, Batch, attention_mask_for, shared_prompt_mask
from cputrain.kernels.chunked_logps import PickedPositions, positions_of
from cputrain.kernels.shared_prompt_attention import shared_prompt_kernel, shared_prompt_layout
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
    completion_starts: torch.Tensor | None = None  # [completions] the row position of its first token
    # the micro-batch's completions left out of its rows (advantage 0 and no KL: they add nothing to
    # the loss or its gradient), still counted in the loss's divisor and the clip ratios' (online_rl.py)
    skipped_completions: int = 0
    skipped_tokens: int = 0

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

    @property
    def shares_prompts(self) -> bool:
        """Whether some row holds several completions after their prompt."""
        return self.attention_mask is not None or len(self.input_ids) < self.completions

    def row_mask(self) -> torch.Tensor:
        """[rows, 1, width, width] bool (True: attend) of shared rows: each completion sees its
        prompt and itself (cputrain.data.batch.shared_prompt_mask). Built where the model's kernel
        is not one shared_prompt_attention follows; kept from run state saved before it was not."""
        if self.attention_mask is not None:
            return self.attention_mask
        rows, width = self.input_ids.shape
        sequence_ids = torch.full((rows, width), -1, dtype=torch.long)
        lengths = self.completion_mask.sum(-1)
        for i, (r, start, length, prompt) in enumerate(zip(self.completion_rows.tolist(), self.completion_starts.tolist(),
                                                           lengths.tolist(), (self.predicted_from[:, 0] + 1).tolist())):
            sequence_ids[r, :prompt] = 0
            sequence_ids[r, start:start + length] = i + 1
        return shared_prompt_mask(sequence_ids, sequence_ids == 0, torch.zeros_like(sequence_ids))


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
    mask = torch.zeros((n, longest), dtype=torch.long)
    predicted_from = torch.zeros((n, longest), dtype=torch.long)
    targets = torch.zeros((n, longest), dtype=torch.long)
    row_of = torch.zeros(n, dtype=torch.long)
    starts = torch.zeros(n, dtype=torch.long)
    for r, members in enumerate(rows):
        prompt = prompt_ids[members[0]]
        p = at = len(prompt)
        input_ids[r, :p] = torch.tensor(prompt, dtype=torch.long)
        for i in members:
            c = len(completion_ids[i])
            ids = torch.tensor(completion_ids[i], dtype=torch.long)
            input_ids[r, at : at + c] = ids
            labels[r, at : at + c] = ids
            targets[i, :c] = ids
            positions[r, at : at + c] = torch.arange(p, p + c)
            mask[i, :c] = 1
            # the first token from the prompt's last position, the next from the completion's own
            predicted_from[i, :c] = torch.arange(at - 1, at - 1 + c)
            predicted_from[i, 0] = p - 1
            row_of[i] = r
            starts[i] = at
            at += c
    # a shared row's mask is not built here: attended a completion at a time it needs none
    # (kernels/shared_prompt_attention.py), and it is width² a row (RolloutBatch.row_mask)
    return RolloutBatch(input_ids, labels, positions, completion_mask=mask,
                        predicted_from=predicted_from, completion_ids=targets, completion_rows=row_of,
                        completion_starts=starts)


def completion_logps(model, batch: RolloutBatch, temperature: float, chunked: bool = False) -> torch.Tensor:
    """Each completion token's log-probability under `model`, its logits divided by the sampling
    temperature as TRL does; [completions, longest completion], 0 past a completion's end.

    `chunked` (model.chunked_loss installed the block-wise head): only the positions that predict a
    completion token go through the head, a block of them at a time, and no logits of the whole
    micro-batch exist (kernels/chunked_logps.py). Otherwise the head runs on the positions from the
    first that predicts a completion token (the model's `logits_to_keep`): a prompt's positions need
    no logits, and at a small model's size the head is the largest product of the step (the demo's
    GRPO step in bf16: 0.93–1.04 s → 0.88–0.89 s, docs/benchmarks/online-rl.md)."""
    segments = batch.shares_prompts and batch.attention_mask is None  # state saved before: its mask
    with shared_prompt_kernel(_config_of(model)) if segments else contextlib.nullcontext() as kernel:
        extra = {}
        if kernel is not None:  # a shared prompt, attended a completion at a time: no row mask
            extra["shared_prompt"] = shared_prompt_layout(
                batch.completion_rows, batch.completion_starts, batch.completion_mask.sum(-1),
                batch.predicted_from[:, 0] + 1, *batch.input_ids.shape, kernel)
        elif batch.shares_prompts:  # under the row's mask: each completion sees its prompt and itself
            extra["attention_mask"] = attention_mask_for(batch.row_mask(), model)
        return _logps(model, batch, temperature, chunked, extra)


def _config_of(model):
    return getattr(model, "module", model).config


def _logps(model, batch: RolloutBatch, temperature: float, chunked: bool, extra: dict) -> torch.Tensor:
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
    picked = positions_of(logits, batch.completion_rows, (batch.predicted_from - offset).clamp(min=0)).float()
    if temperature != 1.0:  # a division of every logit, and again in the backward, for nothing at 1
        picked = picked / temperature
    logps = torch.log_softmax(picked, dim=-1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    return logps * batch.completion_mask
