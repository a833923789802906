"""The bytes decoder_weights() holds beside the model for a rollout, for the memory plan: pure
arithmetic on the model's shape, no torch.

Its query-key-value and gate-up matrices are new tensors (concatenations) always. Each other
projection, and the head, is the model's own tensor unless it has to be made anew: cast (the
products compute in another dtype than the weights are held in, as under the trainer's bf16
autocast over fp32 weights) or merged with a LoRA adapter (LoRA adapts the projections, not the
head). The embedding table is looked up where it is.

Under FSDP2 (`gathered`) nothing is the model's own: every unit is gathered, copied and sharded
again, so the copy is the whole model in the compute dtype, the embedding table included.

Every projection and the head are new too: they are reordered into oneDNN's blocked layout once
per rollout (packed_weights.py), in fp32 and in bf16. That holds where torch has oneDNN (every x86
build) and, for bf16, where oneDNN runs bf16, which is every CPU cputrain chooses bf16 for; elsewhere
the figure is an upper bound by the projections and the head.
"""

from __future__ import annotations

from cputrain.rollouts.decoder_sizes import decoder_sizes
from cputrain.rollouts.kv_cache_size import bytes_per_element


def fused_weight_bytes(config, compute_dtype, weights_dtype, lora: bool = False, gathered: bool = False) -> int:
    """For the model `config` describes (a transformers config or its dict), products computed in
    `compute_dtype` over weights held in `weights_dtype`, with or without LoRA adapters; `gathered`:
    sharded by FSDP2, every tensor a copy."""
    s = decoder_sizes(config)
    hidden, inter, vocab, layers = s.hidden, s.intermediate, s.vocab, s.layers
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    cast = gathered or bytes_per_element(compute_dtype) != bytes_per_element(weights_dtype)
    reordered = str(compute_dtype).removeprefix("torch.") in ("bf16", "bfloat16", "fp32", "float32")
    always = hidden * (q + 2 * kv) + 2 * hidden * inter  # qkv, gate_up
    remade = q * hidden + inter * hidden if cast or lora or reordered else 0  # out, down
    head = vocab * hidden if cast or reordered else 0
    embed = vocab * hidden if gathered else 0  # gathered in the dtype FSDP2 computes in
    norms = (2 * layers + 1) * hidden * 4 if gathered else 0  # copied in fp32
    return (layers * (always + remade) + head + embed) * bytes_per_element(compute_dtype) + norms
