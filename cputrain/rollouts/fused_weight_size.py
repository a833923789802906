"""The bytes decoder_weights() holds beside the model for a rollout, for the memory plan: pure
arithmetic on the model's shape, no torch.

Every projection and the head are new tensors in the compute dtype, whatever dtype the model holds
them in and with or without LoRA adapters: the query-key-value and gate-up matrices are
concatenations, and each weight is reordered into oneDNN's blocked layout once per rollout
(packed_weights.py), in fp32 and in bf16. That holds where torch has oneDNN (every x86 build) and,
for bf16, where oneDNN runs bf16, which is every CPU cputrain chooses bf16 for; elsewhere the
figure is an upper bound by the output and down projections and the head. The embedding table is
looked up where it is.

Under FSDP2 (`gathered`) nothing is the model's own: every unit is gathered, copied and sharded
again, so the copy is the whole model in the compute dtype, the embedding table included.
"""

from __future__ import annotations

from cputrain.rollouts.decoder_sizes import decoder_sizes
from cputrain.rollouts.kv_cache_size import bytes_per_element


def fused_weight_bytes(config, compute_dtype, gathered: bool = False) -> int:
    """For the model `config` describes (a transformers config or its dict), products computed in
    `compute_dtype`; `gathered`: sharded by FSDP2, every tensor a copy."""
    s = decoder_sizes(config)
    hidden, inter, vocab, layers = s.hidden, s.intermediate, s.vocab, s.layers
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    projections = hidden * (q + 2 * kv) + q * hidden + 2 * hidden * inter + inter * hidden  # qkv, out, gate_up, down
    head = vocab * hidden
    embed = vocab * hidden if gathered else 0  # gathered in the dtype FSDP2 computes in
    norms = (2 * layers + 1) * hidden * 4 if gathered else 0  # copied in fp32
    return (layers * projections + head + embed) * bytes_per_element(compute_dtype) + norms
