"""A Llama-family decoder's forward for a rollout, on decoder_weights()'s fused weights: the prompt's
prefill and each one-token decode step, with its own KV cache (paged_kv_cache.py) and a few torch
calls per block, where transformers' modules make dozens.

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
from cputrain.rollouts.packed_weights import linear
from cputrain.rollouts.paged_kv_cache import PagedKvCache


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm on the fp32 residual stream, as one call (its math: x · rsqrt(mean(x²) + eps) · weight)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on rows × positions × heads × dim (transformers' rotate_half form)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class FusedDecoder:
    """Prefill, decode steps and row selection over one rollout's paged cache."""

    def __init__(self, weights: DecoderWeights, rows: int, capacity: int, padding: torch.Tensor):
        self.w = weights
        self.cache = PagedKvCache(len(weights.blocks), rows, weights.kv_heads, weights.head_dim, capacity,
                                  weights.dtype, padding)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, prefill_mask: torch.Tensor | None) -> torch.Tensor:
        """Last position's logits (rows × vocab) of `ids` (rows × new positions) at `positions`: a
        prompt's prefill under `prefill_mask` (bool, rows × 1 × new × new), or a decode step."""
        w = self.w
        rows, new = ids.shape
        x = F.embedding(ids, w.embed).float()
        cos, sin = w.rotary(x, positions)
        cos, sin = cos[:, :, None].to(w.dtype), sin[:, :, None].to(w.dtype)  # rows × new × 1 (every head) × dim
        start = self.cache.advance(new, real=prefill_mask is None)
        end = start + new
        heads, kv_heads = w.heads, w.kv_heads
        q_width, kv_width = heads * w.head_dim, kv_heads * w.head_dim
        for index, block in enumerate(w.blocks):
            h = _rms_norm(x, block.input_norm, w.norm_eps).to(w.dtype)
            qkv = linear(h, block.qkv, block.qkv_bias)
            # the queries and keys rotated together: one pass over both, half the calls of two
            qk = _rotated(qkv[..., :q_width + kv_width].view(rows, new, heads + kv_heads, w.head_dim), cos, sin)
            q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)
            v = qkv[..., q_width + kv_width:].view(rows, new, kv_heads, w.head_dim).transpose(1, 2)
            self.cache.write(index, start, k.reshape(rows * kv_heads, new, w.head_dim),
                             v.reshape(rows * kv_heads, new, w.head_dim))
            if prefill_mask is None:
                attended = self.cache.attend(index, q, end, w.scaling)
            else:
                keys, values = self.cache.prefix(index, end)
                attended = F.scaled_dot_product_attention(
                    q, keys.view(rows, kv_heads, end, w.head_dim), values.view(rows, kv_heads, end, w.head_dim),
                    attn_mask=prefill_mask, scale=w.scaling, enable_gqa=heads != kv_heads).transpose(1, 2)
            x = x + linear(attended.reshape(rows, new, q_width), block.out, block.out_bias)
            h = _rms_norm(x, block.post_norm, w.norm_eps).to(w.dtype)
            gate, up = linear(h, block.gate_up, block.gate_up_bias).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, block.down, block.down_bias)
        return linear(_rms_norm(x[:, -1], w.final_norm, w.norm_eps).to(w.dtype), w.head, None)

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self._forward(ids, positions, mask)

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._forward(tokens, positions, None)

    def select_rows(self, indices: torch.Tensor) -> None:
        self.cache.select_rows(indices)
