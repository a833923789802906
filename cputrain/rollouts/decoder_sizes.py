"""A decoder's sizes read from its config (a transformers config or its dict), for the arithmetic
that needs no model: the rollout's KV cache and fused weights (the memory plan) and online RL's
training rows (objectives.rollout_rows). A multimodal config keeps the decoder's under text_config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


def config_field(config, name: str, default=None):
    """A model config's field, from a transformers config or its dict; `default` where absent or None."""
    value = config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)
    return default if value is None else value


@dataclass(frozen=True)
class DecoderSizes:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def block_matmul_params(self) -> int:
        """A decoder block's projection elements: q, k, v, o; gate, up, down."""
        return self.hidden * (2 * self.heads + 2 * self.kv_heads) * self.head_dim + 3 * self.hidden * self.intermediate


def decoder_sizes(config) -> DecoderSizes:
    config = config_field(config, "text_config", config)
    hidden = int(config_field(config, "hidden_size"))
    heads = int(config_field(config, "num_attention_heads"))
    return DecoderSizes(layers=int(config_field(config, "num_hidden_layers")), hidden=hidden,
                        intermediate=int(config_field(config, "intermediate_size", 4 * hidden)), heads=heads,
                        kv_heads=int(config_field(config, "num_key_value_heads", heads)),
                        head_dim=int(config_field(config, "head_dim", hidden // heads)),
                        vocab=int(config_field(config, "vocab_size", 0)))
