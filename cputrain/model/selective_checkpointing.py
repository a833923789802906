"""model.activation_checkpointing=selective: keep what the matmuls produce, recompute the rest.

Whole-block checkpointing keeps a block's input and runs its whole forward again in the backward,
every matmul included (~a third more compute for the block). Most of a block's saved bytes are not
matmul outputs, though: the norms' fp32 inputs and outputs, the rotated q and k, the key/value
heads repeated for grouped-query attention, the SiLU of the gate and its product with up. Those
cost a few operations per element to redo. This policy (op-level "selective" checkpointing, as
torchtitan's) tells PyTorch's own machinery (torch.utils.checkpoint's `context_fn` with
`create_selective_checkpoint_contexts`) to keep the output of every matmul and of the attention
kernel, and to recompute everything else: the backward repeats no large matmul.

One exception keeps the memory where it pays: a matmul whose contraction is thin against its
output (inner dimension × THIN_RATIO ≤ output width) costs 2·inner FLOPs per output element, few
for the bytes it would keep. LoRA's lora_B (rank 16 into a 4,096- or 14,336-wide output) is one:
keeping it would double what each adapted linear keeps, for ~1% of that linear's FLOPs. Eager
attention's q·kᵀ (head_dim into a sequence-wide row) is another: its batch × heads × seq² output is
recomputed from the kept q and k. cputrain.plan.memory.activations counts what this keeps.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

aten = torch.ops.aten

# Matmuls: (left operand, right operand) positions in the op's arguments.
MATMUL_OPERANDS = {
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.addmm.default: (1, 2),  # a linear with a bias: addmm(bias, input, weightᵀ)
    aten.baddbmm.default: (1, 2),
}
# The attention kernels: their outputs (and the log-sum-exp the backward reads) are kept.
ATTENTION_OPS = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}
# A matmul whose inner dimension × THIN_RATIO is at most its output's width is recomputed.
THIN_RATIO = 4


def is_thin_matmul(left: torch.Tensor, right: torch.Tensor) -> bool:
    """True for a product whose output is wide and cheap: inner × THIN_RATIO ≤ output width."""
    return left.shape[-1] * THIN_RATIO <= right.shape[-1]


def keeps_output(func, args) -> bool:
    """Whether selective checkpointing keeps this op's output for the backward."""
    if func in ATTENTION_OPS:
        return True
    operands = MATMUL_OPERANDS.get(func)
    if operands is None:
        return False
    return not is_thin_matmul(args[operands[0]], args[operands[1]])


def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """The policy torch.utils.checkpoint asks about each op of a checkpointed block's forward."""
    return CheckpointPolicy.MUST_SAVE if keeps_output(func, args) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """`context_fn` for torch.utils.checkpoint.checkpoint: a fresh pair of contexts per call, the
    first keeping the outputs `policy` names in the forward, the second handing them back in the
    recompute instead of running those ops again. `policy` is looked up at each call, so a test
    can count what it keeps by replacing it."""
    return create_selective_checkpoint_contexts(policy)


def checkpoint_kwargs() -> dict:
    """What torch.utils.checkpoint.checkpoint takes for selective checkpointing. Non-reentrant:
    `context_fn` works only there (and it composes with FSDP2 and torch.compile)."""
    return {"use_reentrant": False, "context_fn": selective_contexts}
