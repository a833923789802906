"""The bytes a rollout's KV cache holds, for the memory plan: pure arithmetic on the model's
shape, no torch, so the plan can count it before any model exists.

sample() sizes its cache once for the whole rollout: every row holds the longest prompt of its
batch plus max_new_tokens positions, in every full-attention layer, keys and values, in the
dtype the policy computes in: the model's dtype, or bf16 where the trainer's bf16 autocast is on.
"""

from __future__ import annotations

from collections.abc import Mapping

# The fused decoder's cache (paged_kv_cache.py) holds positions in pages of this many: its rows
# hold the rollout's positions rounded up to a whole page.
PAGE_POSITIONS = 32

_BYTES_PER_ELEMENT = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
                      "half": 2, "float64": 8, "fp64": 8}


def config_field(config, name: str, default=None):
    """A model config's field, from a transformers config or its dict; `default` where absent or None."""
    value = config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
    return default if value is None else value


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
    config = config_field(config, "text_config", config)  # a multimodal config keeps the decoder's shape here
    layers = int(config_field(config, "num_hidden_layers"))
    heads = int(config_field(config, "num_attention_heads"))
    kv_heads = int(config_field(config, "num_key_value_heads", heads))
    head_dim = int(config_field(config, "head_dim", int(config_field(config, "hidden_size")) // heads))
    return 2 * layers * rows * kv_heads * head_dim * max_len * bytes_per_element(dtype)
