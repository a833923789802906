"""The matrix products of one micro-batch's forward and backward through a Llama, every weight
trained: the 6·N of cputrain.metrics.flops, product by product.

Each linear layer y = x·Wᵀ (no bias) over T = micro_batch × seq_len tokens runs three products:
  forward       [T, in] × [in, out]
  input grad    [T, out] × [out, in]   (dL/dx, handed to the layer below)
  weight grad   [in, T] × [T, out]     (dL/dW; every weight is trained)
each 2·T·in·out FLOPs, so a layer of in·out weights costs 6·in·out FLOPs a token. A decoder layer
has seven such layers (q, k, v, o, gate, up, down), the lm_head one more (vocab × hidden, tied to
the embedding or not: the product runs either way). The input embedding is a lookup, and its
gradient a scatter-add: no product. Norm weights are vectors: no product either, which is why the
products add up to 6 × the non-embedding *matrix* parameters × T, a little less than the 6·N of
cputrain.metrics.flops (whose N counts the norms too). Attention's own products (scores, weighted
values) are not here: they run inside the attention kernel.

A Gemm is (m, k, n): an [m, k] × [k, n] product, `count` times per micro-batch.
"""

from __future__ import annotations

from typing import NamedTuple


class Gemm(NamedTuple):
    m: int
    k: int
    n: int
    count: int  # how many times one micro-batch runs it
    product: str  # which layer and pass, e.g. "mlp.down_proj weight grad"

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n * self.count


def linear_gemms(name: str, in_features: int, out_features: int, tokens: int, count: int) -> list[Gemm]:
    """The three products of a linear layer without bias over `tokens` tokens."""
    return [Gemm(tokens, in_features, out_features, count, f"{name} forward"),
            Gemm(tokens, out_features, in_features, count, f"{name} input grad"),
            Gemm(in_features, tokens, out_features, count, f"{name} weight grad")]


def step_gemms(arch: dict, vocab_size: int, micro_batch: int, seq_len: int) -> list[Gemm]:
    """Every product of one micro-batch's forward + backward through the Llama that `arch` (the
    fields of a transformers LlamaConfig: hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, optionally head_dim) and `vocab_size` describe."""
    hidden, intermediate = arch["hidden_size"], arch["intermediate_size"]
    layers, heads = arch["num_hidden_layers"], arch["num_attention_heads"]
    kv_heads = arch.get("num_key_value_heads") or heads
    head_dim = arch.get("head_dim") or hidden // heads  # LlamaConfig's default
    tokens = micro_batch * seq_len
    # (name, in, out) of each linear layer of a decoder layer, as transformers' LlamaDecoderLayer has them
    per_layer = [("self_attn.q_proj", hidden, heads * head_dim), ("self_attn.k_proj", hidden, kv_heads * head_dim),
                 ("self_attn.v_proj", hidden, kv_heads * head_dim), ("self_attn.o_proj", heads * head_dim, hidden),
                 ("mlp.gate_proj", hidden, intermediate), ("mlp.up_proj", hidden, intermediate),
                 ("mlp.down_proj", intermediate, hidden)]
    gemms = [g for name, fan_in, fan_out in per_layer for g in linear_gemms(name, fan_in, fan_out, tokens, layers)]
    return gemms + linear_gemms("lm_head", hidden, vocab_size, tokens, 1)


def total_flops(gemms: list[Gemm]) -> int:
    return sum(g.flops for g in gemms)
