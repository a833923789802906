"""The working set of a training step beyond the stored state: activations and buffers.

Activations are the tensors autograd saves in the forward pass of one micro-batch for the
backward pass (t = micro_batch × seq_len tokens, h hidden, i MLP width, kv = key/value width,
V vocabulary). Per Llama decoder block, counting what each op saves:

    RMSNorm ×2         2 × (2·t·h + t)      input and normalised output, 1/rms
    q, k, v, RoPE      t·h + 2·t·kv         rotated q and k, v (cos/sin are shared)
    GQA expand         2·t·h                k and v repeated to every head (when kv < h)
    attention          t·h                  output (the CPU flash kernel keeps no t² matrix;
                                            eager attention keeps b·heads·s² more: eager_attention_bytes)
    o_proj input       t·h                  the contiguous [t, h] copy
    SwiGLU MLP         4·t·i                gate, silu(gate), up, product

and after the blocks: the final norm (2·t·h), the logits and their log-softmax (2·t·V) plus
one more t·V for the gradient of the logits in the backward. This is the same bookkeeping as
Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", 2022),
redone for Llama's blocks. With activation checkpointing a block keeps only its input (t·h),
and one block at a time is recomputed in full. With the first n of L blocks checkpointed, the
L − n others keep all of theirs: their backward runs first and frees them before any
checkpointed block is recomputed, so the peak is n inputs + max(L − n, 1) whole blocks.

Selective checkpointing (cputrain.model.selective_checkpointing) keeps, per block, its input and
what its matmuls and its attention kernel produce, and recomputes the rest in the backward:

    q, k, v projections  t·h + 2·t·kv        before RoPE (the rotated copies are recomputed)
    attention            t·h + t·heads       output, and the fp32 log-sum-exp the backward reads
    o_proj, down_proj    2·t·h               outputs (what the residual adds read)
    gate, up             2·t·i               outputs (SiLU and the product are recomputed)

(the norms, RoPE, the GQA expand, SiLU × up and the casts are recomputed), about half of a whole
block for Llama's shapes; one block at a time is then recomputed in full, as with whole blocks.
LoRA's lora_A outputs (t·r) are kept; lora_B's (t·out, a thin product) and the adapters' dropout
are recomputed. Eager attention's q·kᵀ is recomputed where it is thin (head_dim × 4 ≤ seq).
"N+selective" checkpoints the first N blocks whole and the others selectively: N inputs, L − N
selective blocks, and one block recomputed in full at a time.

Under bf16 autocast the matmul outputs are bf16 (2 bytes) while norms and the softmax stay
fp32; autocast also keeps a bf16 copy of every fp32 weight used in the forward for the backward.

LoRA: the backward still runs through every frozen block to reach the adapters, so the
activations above stay (a frozen linear saves no input of its own, but its adapter's lora_A
saves that same tensor). Each adapted linear adds lora_A's output (t·r, saved by lora_B) and,
with model.lora.dropout > 0, its own dropout of the input (t·in, and a t·in byte mask). Under
bf16 compute a frozen bf16 embedding makes the hidden states between blocks bf16: the block
inputs activation checkpointing keeps are 2 bytes each, and no weight of the frozen base is cast
by autocast. Under fp32 compute a bf16 base is converted one matrix at a time (upcast_copy_bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.config import checkpointing_split
from cputrain.plan.model_shape import ModelShape


@dataclass(frozen=True)
class ActivationBytes:
    saved_bytes: int  # activations kept for the backward of one micro-batch
    weight_copy_bytes: int  # bf16 copies of weights autocast holds until the backward; fp32 ones of a bf16 base


def _block_elements(m: ModelShape, tokens: int) -> tuple[int, int]:
    """(elements kept in fp32, elements produced by matmuls) saved by one decoder block."""
    head_dim = m.hidden // m.heads
    kv = m.kv_heads * head_dim
    norms = 2 * (2 * tokens * m.hidden + tokens)
    matmul = tokens * m.hidden + 2 * tokens * kv + tokens * m.hidden + tokens * m.hidden + 4 * tokens * m.intermediate
    if m.kv_heads < m.heads:
        matmul += 2 * tokens * m.hidden
    return norms, matmul


def selective_block_bytes(m: ModelShape, micro_batch: int, seq_len: int, matmul_bytes: int,
                          eager_attention: bool = False) -> int:
    """What one block keeps under selective checkpointing beyond its input: the outputs of its
    matmuls and attention kernel (docstring above), lora_A's outputs, and under eager attention
    its q·kᵀ where that product is not thin enough to be recomputed."""
    from cputrain.model.selective_checkpointing import THIN_RATIO

    tokens = micro_batch * seq_len
    head_dim = m.hidden // m.heads
    kv = m.kv_heads * head_dim
    matmul = 4 * tokens * m.hidden + 2 * tokens * kv + 2 * tokens * m.intermediate
    kept = matmul * matmul_bytes
    if eager_attention:
        if head_dim * THIN_RATIO > seq_len:  # q·kᵀ kept: batch × heads × seq² in the compute dtype
            kept += micro_batch * m.heads * seq_len * seq_len * matmul_bytes
    else:
        kept += tokens * m.heads * 4  # the flash kernel's fp32 log-sum-exp
    adapters = [p for p in m.params if p.unit != "root" and (".lora_A." in p.name or ".lora_B." in p.name)]
    for p in (p for p in adapters if p.unit == adapters[0].unit):  # one block's adapters
        # lora_A (r × in): its t × r output; lora_B (out × r): its t × out output where not thin
        if ".lora_A." in p.name or p.shape[1] * THIN_RATIO > p.shape[0]:
            kept += tokens * p.shape[0] * matmul_bytes
    return kept


def adapter_bytes(m: ModelShape, tokens: int, matmul_bytes: int, dropout: float = 0.0) -> dict[str, int]:
    """Bytes the LoRA adapters save per FSDP unit ("layers.N", "root"): lora_A's output (t × r)
    per adapted linear, and with dropout its dropped-out input (t × in) and mask (1 byte each)."""
    out: dict[str, int] = {}
    for a in m.adapter_inputs():
        rank, width = a.shape[0], a.shape[-1]
        saved = tokens * rank * matmul_bytes
        if dropout > 0:
            saved += tokens * width * (matmul_bytes + 1)
        out[a.unit] = out.get(a.unit, 0) + saved
    return out


def head_bytes(m: ModelShape, tokens: int, matmul_bytes: int, chunked_loss: bool) -> int:
    """The head and its loss at the end of the forward. Plain: the logits upcast to fp32, their
    log-softmax and its gradient, each tokens × vocabulary × 4 bytes. Chunked
    (kernels/chunked_loss.py): one block's fp32 logits, the saved gradient of the hidden states,
    and for a trained head the gradient of every logit in the compute dtype and the head's weight
    gradient (a frozen LoRA head has neither)."""
    from cputrain.kernels.chunked_loss import block_rows

    if any(p.name == "score.weight" for p in m.params):  # a reward model's head: one fp32 score a token
        return tokens * m.hidden * 4
    if not chunked_loss:
        return 2 * tokens * m.hidden * 4 + 3 * tokens * m.vocab * 4
    block = min(tokens, block_rows(m.vocab)) * m.vocab * (4 + (matmul_bytes if matmul_bytes != 4 else 0))
    hidden = tokens * m.hidden * (4 + matmul_bytes)
    if m.lora:
        return block + hidden
    return tokens * m.vocab * matmul_bytes + block + hidden + m.vocab * m.hidden * 4


def upcast_copy_bytes(m: ModelShape, precision: str) -> int:
    """fp32 compute over a LoRA base stored in bf16 (cputrain.lora.base_storage): each frozen
    matrix is converted to fp32 for its matmul, one at a time; the largest (for Llama the head,
    used last, when every activation is saved) is the one that counts."""
    if precision == "bf16":
        return 0
    return max((p.numel * 4 for p in m.params if not p.trainable and len(p.shape) == 2 and p.stored_bytes < 4),
               default=0)


def eager_attention_bytes(m: ModelShape, micro_batch: int, seq_len: int, matmul_bytes: int) -> int:
    """What transformers' eager attention keeps per block beyond the flash kernel: the attention
    matrix (micro-batch × heads × seq × seq) as the fp32 softmax saves it, and under bf16 the bf16
    copy the matmul with V saves (dropout at 0 passes it through)."""
    return micro_batch * m.heads * seq_len * seq_len * (4 + (matmul_bytes if matmul_bytes != 4 else 0))


def attention_mask_bytes(micro_batch: int, seq_len: int, precision: str, strategy: str) -> int:
    """A micro-batch's 4D mask where rows hold several sequences (cputrain.data.batch.attention_mask_for),
    kept through its backward: the additive one every layer reads, in the dtype the queries compute
    in (bf16 under autocast and ZeRO-3's bf16 weights; under fsdp built in fp32 from the shards' dtype,
    and cast to bf16 by FSDP2's root), and the bool mask a shared prompt's batch holds (1 byte).
    micro-batch × seq_len² elements: online RL's wider shared rows hold no more
    (cputrain.objectives.rollout_rows)."""
    additive = 4 if precision != "bf16" else 4 + 2 if strategy == "fsdp" else 2
    return micro_batch * seq_len * seq_len * (1 + additive)


def activation_bytes(m: ModelShape, micro_batch: int, seq_len: int, precision: str, checkpointing: bool | int | str,
                     local_weight_params: int, lora_dropout: float = 0.0, chunked_loss: bool = False,
                     eager_attention: bool = False) -> ActivationBytes:
    tokens = micro_batch * seq_len
    matmul_bytes = 2 if precision == "bf16" else 4
    norms, matmul = _block_elements(m, tokens)
    adapters = adapter_bytes(m, tokens, matmul_bytes, lora_dropout)
    block = norms * 4 + matmul * matmul_bytes + max((v for u, v in adapters.items() if u != "root"), default=0)
    if eager_attention:
        block += eager_attention_bytes(m, micro_batch, seq_len, matmul_bytes)
    # under fp32 compute the stream between blocks is fp32 whatever the base's dtype
    residual_bytes = m.residual_bytes if precision == "bf16" else 4
    whole, selective = checkpointing_split(checkpointing, m.layers)
    kept_whole = m.layers - whole - selective
    block_input = tokens * m.hidden * residual_bytes
    kept = selective_block_bytes(m, micro_batch, seq_len, matmul_bytes, eager_attention) if selective else 0
    # Checkpointed blocks keep their input (selective ones their matmul outputs as well); the
    # blocks that keep everything are the last ones, whose backward runs first and frees them
    # before any checkpointed block is recomputed, in full, one at a time.
    blocks = (whole * block_input + selective * (block_input + kept)
              + max(kept_whole, 1 if whole + selective else 0) * block)
    head = head_bytes(m, tokens, matmul_bytes, chunked_loss) + adapters.get("root", 0)  # an adapted head
    weight_copies = local_weight_params * 2 if precision == "bf16" else upcast_copy_bytes(m, precision)
    return ActivationBytes(saved_bytes=blocks + head, weight_copy_bytes=weight_copies)
