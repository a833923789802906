"""A micro-batch as the model takes it, and padding rows into one.

Every kind of data gives the trainer rows (cputrain.data.rows) with `len(rows)` and
`rows.batch(indices)`: packed text (cputrain.data.text.rows.TokenRows: every token a label,
positions 0…seq_len-1), chat or prompt/completion examples (cputrain.data.examples.rows.ExampleRows:
labels only on answers, positions restarting per example), preference pairs
(cputrain.data.preference.rows.PairRows: as examples, with the sequence of each token) and
unpaired feedback (cputrain.data.feedback.rows.FeedbackRows: a FeedbackBatch, each example's label
and the batch of its KL sequences beside). Rows where sequences share a prompt (preference pairs,
online RL's groups of completions) carry the 4D mask shared_prompt_mask builds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # a label the loss skips (transformers' and the chunked loss's rule)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [micro-batch, tokens]
    labels: torch.Tensor  # [micro-batch, tokens]; the model shifts them: token t+1 is t's target
    position_ids: torch.Tensor | None = None  # None: 0 … tokens-1 in every row
    # Preference pairs (cputrain.data.preference): the micro-batch's sequence each token is in, 2p for
    # pair p's chosen, 2p+1 for its rejected, -1 padding. None for text and examples.
    sequence_ids: torch.Tensor | None = None
    # DPO's reference log-probabilities of those sequences (summed), where they were computed
    # before training (full weights: cputrain.objectives); None: computed live, or not wanted.
    reference_logps: torch.Tensor | None = None
    # [micro-batch, 1, tokens, tokens] bool, True: attend; pairs with a shared prompt
    # (cputrain.data.preference.rows) carry it. None: model_inputs builds packed rows' from their positions (packed_mask).
    attention_mask: torch.Tensor | None = None
    # Preference pairs with a margin each (data.margin_field): the reward model's loss subtracts it.
    margins: torch.Tensor | None = None

    @property
    def pairs(self) -> int:
        """Preference pairs in the micro-batch (0 for text and examples)."""
        return 0 if self.sequence_ids is None else (int(self.sequence_ids.max()) + 1) // 2

    @property
    def trained_targets(self) -> int:
        """Targets that carry loss (the first position of a row is never a target)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    def model_inputs(self, model=None) -> dict:
        """The model's keyword arguments; a 4D attention mask as `model`'s kernel takes it (attention_mask_for)."""
        # use_cache=False: training keeps no KV cache, and with one transformers skips building the
        # block-diagonal mask from packed position ids, silently letting examples attend to each
        # other (measured: 0.5 logit error on the second of two packed examples with the cache on).
        inputs = {"input_ids": self.input_ids, "labels": self.labels, "use_cache": False}
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        if self.attention_mask is not None:
            inputs["attention_mask"] = attention_mask_for(self.attention_mask, model)
        elif self.position_ids is not None and kernel_of(model) == "sdpa":
            # Packed examples: transformers would build this mask from the positions as bool, and
            # sdpa would convert it in every layer (attention_mask_for); built here, it is one tensor.
            mask = packed_mask(self.position_ids)
            if mask is not None:
                inputs["attention_mask"] = attention_mask_for(mask, model)
        return inputs


def kernel_of(model) -> str | None:
    """The attention kernel of `model` (wrapped or not: DDP's and ZeRO-3's `.module`); None without one."""
    inner = getattr(model, "module", model)
    return None if inner is None else getattr(inner.config, "_attn_implementation", "sdpa")


def packed_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[rows, 1, tokens, tokens] bool (True: attend) of rows packed with several sequences: a token
    sees the earlier tokens of its own sequence, a sequence starting wherever the positions do not
    go up by one (transformers' rule for packed position ids: masking_utils.find_packed_sequence_indices,
    the padding after a row's last example a sequence of its own). None where every row is one
    sequence: the kernel's own causal path, which computes half the pairs, stays."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    starts = step != 1
    if not bool(starts[:, 1:].any()):
        return None
    sequence = starts.cumsum(-1)
    return ((sequence[:, :, None] == sequence[:, None, :]) & _causal(position_ids.shape[1]))[:, None]


def attention_mask_for(mask: torch.Tensor, model=None) -> torch.Tensor:
    """A 4D bool mask (True: attend) as `model`'s attention kernel takes it, additive: 0 where a key
    is seen, a large negative elsewhere; transformers passes a 4D mask through as it is
    (masking_utils). `model` may be wrapped (DDP, ZeRO-3's `.module`); None: the bool mask.

    - eager ADDS the mask to the scores: the dtype's minimum in the dtype of the input embeddings,
      as transformers' own eager_mask is typed (fp32 under bf16 autocast over fp32 weights).
    - sdpa: -inf in the dtype its queries compute in (autocast's, else the weights'), the mask sdpa
      itself makes of a bool one. Given the bool mask, sdpa converts it in every layer, and each
      layer's autograd keeps its own copy until the backward: micro-batch × tokens² × 2 bytes a
      block in bf16 (measured, 16 blocks at 2,048 tokens: 260 MiB held after the forward against
      104). Given this one, every layer reads and keeps the same tensor. (Under FSDP2 the weights
      are the fp32 shards outside the forward, and its root casts the mask to bf16 once, with
      the other floating inputs.)"""
    kernel = kernel_of(model)
    if kernel is None:
        return mask
    weights_dtype = getattr(model, "module", model).get_input_embeddings().weight.dtype
    if kernel == "eager":
        dtype, blocked = weights_dtype, torch.finfo(weights_dtype).min
    else:
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else weights_dtype
        blocked = float("-inf")
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, blocked)


@functools.lru_cache(maxsize=2)
def _causal(tokens: int) -> torch.Tensor:
    """The lower triangle of tokens² (tokens² bytes), kept: every batch of a run has one width."""
    return torch.ones(tokens, tokens, dtype=torch.bool).tril_()


def shared_prompt_mask(sequence_ids: torch.Tensor, visible_prompt: torch.Tensor,
                       groups: torch.Tensor | None = None) -> torch.Tensor:
    """[micro-batch, 1, tokens, tokens] bool (True: attend) of rows where sequences share a prompt:
    causal; a token sees its own sequence's tokens (sequence_ids, each sequence one run of a row)
    and, before its sequence, the tokens `visible_prompt` marks in its group (`groups`, an id per
    token; None: its pair, sequence_ids // 2); padding (-1) sees itself only. Preference pairs
    (cputrain.data.preference.rows): a rejected sequence sees its chosen one's prompt 0…P-2. Online
    RL (cputrain.objectives.rollout_batch): each completion sees its row's prompt, a sequence of its
    own. Filled block by block: a row is mostly False, its blocks a few sequences' squares."""
    rows, tokens = sequence_ids.shape
    groups = sequence_ids // 2 if groups is None else groups
    mask = torch.zeros(rows, 1, tokens, tokens, dtype=torch.bool)
    causal = _causal(tokens)
    for i in range(rows):
        seq = sequence_ids[i]
        starts = [0, *(torch.nonzero(seq[1:] != seq[:-1]).flatten() + 1).tolist()]
        for a, b, sid in zip(starts, [*starts[1:], tokens], seq[starts].tolist()):
            if sid < 0:  # padding: each token itself
                at = torch.arange(a, b)
                mask[i, 0, at, at] = True
                continue
            mask[i, 0, a:b, a:b] = causal[: b - a, : b - a]
            seen = visible_prompt[i, :a] & (groups[i, :a] == groups[i, a])
            at = torch.nonzero(seen).flatten()
            if len(at):  # the group's prompt before this sequence
                lo, hi = int(at[0]), int(at[-1]) + 1
                mask[i, 0, a:b, lo:hi] |= seen[lo:hi]
    return mask


def padded(rows: list, width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows given as (ids, labels, positions, …) numpy arrays as [len(rows), width] tensors: ids
    padded with `pad_id`, labels with IGNORE_INDEX, and the padding's positions 0, 1, … after the
    row's end: the padding is a block of its own."""
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab, pos, *_) in enumerate(rows):
        n = len(ids)
        input_ids[i, :n] = torch.from_numpy(ids)
        labels[i, :n] = torch.from_numpy(lab)
        positions[i, :n] = torch.from_numpy(pos)
        positions[i, n:] = torch.arange(width - n)
    return input_ids, labels, positions
