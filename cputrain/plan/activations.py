"""The working set of a training step beyond the stored state: activations and buffers.

Activations are the tensors autograd saves in the forward pass of one micro-batch for the
backward pass (t = micro_batch × seq_len tokens, h hidden, i MLP width, kv = key/value width,
V vocabulary). Per Llama decoder block, counting what each op saves:

    RMSNorm ×2         2 × (2·t·h + t)      input and normalised output, 1/rms
    q, k, v, RoPE      t·h + 2·t·kv         rotated q and k, v (cos/sin are shared)
    GQA expand         2·t·h                k and v repeated to every head (when kv < h)
    attention          t·h                  output (the CPU flash kernel keeps no t² matrix)
    o_proj input       t·h                  the contiguous [t, h] copy
    SwiGLU MLP         4·t·i                gate, silu(gate), up, product

and after the blocks: the final norm (2·t·h), the logits and their log-softmax (2·t·V) plus
one more t·V for the gradient of the logits in the backward. This is the same bookkeeping as
Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022),
redone for Llama's blocks. With activation checkpointing a block keeps only its input (t·h),
and one block at a time is recomputed in full.

Under bf16 autocast the matmul outputs are bf16 (2 bytes) while norms and the softmax stay
fp32; autocast also keeps a bf16 copy of every weight used in the forward for the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.plan.model_shape import ModelShape


@dataclass(frozen=True)
class ActivationBytes:
    saved_bytes: int  # activations kept for the backward of one micro-batch
    weight_copy_bytes: int  # bf16 copies of weights held by autocast until the backward


def _block_elements(m: ModelShape, tokens: int) -> tuple[int, int]:
    """(elements kept in fp32, elements produced by matmuls) saved by one decoder block."""
    head_dim = m.hidden // m.heads
    kv = m.kv_heads * head_dim
    norms = 2 * (2 * tokens * m.hidden + tokens)
    matmul = tokens * m.hidden + 2 * tokens * kv + tokens * m.hidden + tokens * m.hidden + 4 * tokens * m.intermediate
    if m.kv_heads < m.heads:
        matmul += 2 * tokens * m.hidden
    return norms, matmul


def activation_bytes(m: ModelShape, micro_batch: int, seq_len: int, precision: str, checkpointing: bool,
                     local_weight_params: int) -> ActivationBytes:
    tokens = micro_batch * seq_len
    matmul_bytes = 2 if precision == "bf16" else 4
    norms, matmul = _block_elements(m, tokens)
    block = norms * 4 + matmul * matmul_bytes
    if checkpointing:
        blocks = m.layers * tokens * m.hidden * 4 + block  # block inputs + one block recomputed
    else:
        blocks = m.layers * block
    head = 2 * tokens * m.hidden * 4 + 3 * tokens * m.vocab * 4  # logits are upcast to fp32 for the loss
    weight_copies = local_weight_params * 2 if precision == "bf16" else 0
    return ActivationBytes(saved_bytes=blocks + head, weight_copy_bytes=weight_copies)
