"""Attention for a one-token decode step, plugged in through transformers' AttentionInterface for
the length of a rollout: two batched products and a softmax over the cache's positions so far.

torch's scaled_dot_product_attention on CPU runs its flash kernel even for one query, and that
kernel is slow there: at 64 rows × 4 heads × 80 positions × 64 dims on one core it took 0.69 ms
(fp32) and 2.3 ms (bf16) where these products take 0.56 ms and 1.1 ms. A prompt's prefill (many
queries) still goes to sdpa."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from cputrain.kernels.attention_swap import swapped_attention

NAME = "cputrain_rollout_decode"


def rollout_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query rows × heads × 1 × dim against keys and
    values rows × kv-heads × positions × dim; `attention_mask` additive, rows × 1 × 1 × positions.
    The softmax runs in fp32, as eager attention's does."""
    if query.shape[2] != 1 or attention_mask is None or attention_mask.dtype == torch.bool:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, _, dim = query.shape
    kv_heads, positions = key.shape[1], key.shape[2]
    group = heads // kv_heads  # grouped-query attention: a kv head's query heads share one product
    # keys × query, not query × keysᵀ: the keys are a view of the preallocated cache, and a transposed
    # strided bf16 operand is copied first (0.72 ms against 0.41 ms at 64 rows × 4 heads × 80
    # positions, one core; fp32 the same either way)
    scores = torch.bmm(key.reshape(rows * kv_heads, positions, dim),
                       query.reshape(rows * kv_heads, group, dim).transpose(1, 2)).transpose(1, 2)
    scores = scores.reshape(rows, heads, positions).float() * scaling + attention_mask.view(rows, 1, positions).float()
    weights = scores.softmax(dim=-1).to(value.dtype).view(rows * kv_heads, group, positions)
    out = torch.bmm(weights, value.reshape(rows * kv_heads, positions, dim))
    return out.view(rows, heads, 1, dim).transpose(1, 2), None


@contextmanager
def decode_attention(config):
    """For the block: the model `config` describes attends through rollout_attention, where it
    attends through sdpa or eager and this transformers has an AttentionInterface; yields whether
    it does (if not, the model's own attention runs, and the masks must be its kind)."""
    with swapped_attention(config, NAME, rollout_attention) as before:
        yield before is not None
