"""A Llama-family decoder's forward for a rollout, on decoder_weights()'s fused weights: the prompt's
prefill and each one-token decode step, with its own KV cache (one key and one value tensor per
block, sized once for the rollout) and a few torch calls per block, where transformers' modules
make dozens.

The math is the model's own: RMSNorm in fp32, the model's rotary embedding module, SiLU-gated MLP,
grouped-query attention with the scaling the model's attention holds. The residual stream stays in
fp32 (as it does under the trainer's autocast over fp32 weights); the products run in the weights'
dtype. Greedy decoding equals the model's own generate() token for token
(tests/unit/test_rollouts.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cputrain.rollouts.decoder_weights import DecoderWeights



def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on rows × heads × positions × dim (transformers' rotate_half form)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """One query a row (rows × heads × 1 × dim) against the cache (rows × kv-heads × positions × dim),
    `mask` additive (rows × 1 × 1 × positions); rows × 1 × heads × dim out. The query rows times
    the keys transposed: at ~100M (64 rows × 12 heads × 96 positions, 12 blocks, bf16, 2 threads)
    6.9 ms a step for the scores against 10.2 ms the other way round (fp32 the same either way)."""
    rows, heads, _, dim = q.shape
    kv_heads, positions = keys.shape[1], keys.shape[2]
    group = heads // kv_heads  # grouped-query attention: a kv head's query heads share one product
    scores = torch.bmm(q.reshape(rows * kv_heads, group, dim),
                       keys.reshape(rows * kv_heads, positions, dim).transpose(1, 2))
    scores = scores.view(rows, heads, positions).float() * scaling + mask.view(rows, 1, positions).float()
    weights = scores.softmax(dim=-1).to(values.dtype).view(rows * kv_heads, group, positions)
    out = torch.bmm(weights, values.reshape(rows * kv_heads, positions, dim))
    return out.view(rows, heads, 1, dim).transpose(1, 2)


class FusedDecoder:
    """Prefill, decode steps and row selection over one rollout's cache."""

    def __init__(self, weights: DecoderWeights, rows: int, capacity: int):
        self.w = weights
        shape = (rows, weights.kv_heads, capacity, weights.head_dim)
        # zeros, not empty: a step attends over positions not written yet (masked, see span), and a
        # masked weight times uninitialised memory could be 0 × NaN
        self.keys = [torch.zeros(shape, dtype=weights.dtype) for _ in weights.blocks]
        self.values = [torch.zeros(shape, dtype=weights.dtype) for _ in weights.blocks]
        self.capacity = capacity
        self.length = 0

    def span(self, end: int) -> int:
        """How many cached positions a decode step attends over when `end` are written (its mask's
        width; the positions past `end` are masked here). In fp32, `end`: the products read a
        slice of the cache where it lies. In bf16, all of them: a slice up to `end` is not
        contiguous, and torch's bf16 batched product (oneDNN's) copies such an operand whole first,
        0.76 ms for each block's keys and again for its values at 64 rows × 4 heads × 80 of 96
        positions (the demo's model, 2 threads), two thirds of the decode step; reading every
        position costs less than copying the written ones (a copy reads and writes them, then the
        product reads them again) until the cache is three times longer than what is written."""
        return end if self.w.dtype == torch.float32 else self.capacity

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Last position's logits (rows × vocab) of `ids` (rows × new positions) at `positions`,
        attending to the cache and themselves under `mask` (bool for a prefill, additive for a step)."""
        w = self.w
        rows, new = ids.shape
        x = F.embedding(ids, w.embed).float()
        cos, sin = w.rotary(x, positions)
        cos, sin = cos[:, None].to(w.dtype), sin[:, None].to(w.dtype)
        start, end = self.length, self.length + new
        span = mask.shape[-1]
        if span > end:  # the positions beyond the written ones are masked out
            mask = mask.clone()
            mask[..., end:span] = torch.finfo(mask.dtype).min
        q_width, kv_width = w.heads * w.head_dim, w.kv_heads * w.head_dim
        for block, keys, values in zip(w.blocks, self.keys, self.values):
            h = _rms_norm(x, block.input_norm, w.norm_eps).to(w.dtype)
            q, k, v = F.linear(h, block.qkv, block.qkv_bias).split((q_width, kv_width, kv_width), dim=-1)
            q = _rotated(q.view(rows, new, w.heads, w.head_dim).transpose(1, 2), cos, sin)
            keys[:, :, start:end] = _rotated(k.view(rows, new, w.kv_heads, w.head_dim).transpose(1, 2), cos, sin)
            values[:, :, start:end] = v.view(rows, new, w.kv_heads, w.head_dim).transpose(1, 2)
            if new == 1:
                attended = _decode_attention(q, keys[:, :, :span], values[:, :, :span], mask, w.scaling)
            else:
                attended = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=mask,
                                                          scale=w.scaling, enable_gqa=w.heads != w.kv_heads)
                attended = attended.transpose(1, 2)
            x = x + F.linear(attended.reshape(rows, new, q_width), block.out, block.out_bias)
            h = _rms_norm(x, block.post_norm, w.norm_eps).to(w.dtype)
            gate, up = F.linear(h, block.gate_up, block.gate_up_bias).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, block.down, block.down_bias)
        self.length = end
        return F.linear(_rms_norm(x[:, -1], w.final_norm, w.norm_eps).to(w.dtype), w.head)

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self._forward(ids, positions, mask)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens, positions, mask)

    def select_rows(self, indices: torch.Tensor) -> None:
        self.keys = [k.index_select(0, indices) for k in self.keys]
        self.values = [v.index_select(0, indices) for v in self.values]
