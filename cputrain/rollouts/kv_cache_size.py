"""The bytes a rollout's KV cache holds, for the memory plan: pure arithmetic on the model's
shape, no torch, so the plan can count it before any model exists.

sample() sizes its cache once for the whole rollout: every row holds the longest prompt of its
batch plus max_new_tokens positions, in every full-attention layer, keys and values, in the
dtype the policy computes in: the model's dtype, or bf16 where the trainer's bf16 autocast is on.
The fused decoder holds a prompt's part once for all the rows that complete it (paged_kv_cache.py)
until rows leave the batch; the figure here, a copy a row, bounds it from above.
"""

from __future__ import annotations

from cputrain.rollouts.decoder_sizes import decoder_sizes

# The fused decoder's cache (paged_kv_cache.py) holds positions in pages of this many: its rows
# hold the rollout's positions rounded up to a whole page.
PAGE_POSITIONS = 32

_BYTES_PER_ELEMENT = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
                      "half": 2, "float64": 8, "fp64": 8}


def bytes_per_element(dtype) -> int:
    """2 for "bf16"/"bfloat16"/torch.bfloat16, 4 for fp32, …"""
    name = str(dtype).removeprefix("torch.")
    if name not in _BYTES_PER_ELEMENT:
        raise ValueError(f"no element size for dtype {dtype!r}; known: {sorted(_BYTES_PER_ELEMENT)}")
    return _BYTES_PER_ELEMENT[name]


def kv_cache_bytes(config, rows: int, max_len: int, dtype) -> int:
    """Keys and values of `rows` sequences of `max_len` positions (the longest prompt +
    max_new_tokens) in every layer of the model `config` describes (a transformers config or its
    dict; grouped-query attention counted by its key-value heads)."""
    s = decoder_sizes(config)
    return 2 * s.layers * rows * s.kv_heads * s.head_dim * max_len * bytes_per_element(dtype)
