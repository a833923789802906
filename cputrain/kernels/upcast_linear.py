"""A frozen linear layer stored in bf16 and computed in fp32, saving only its bf16 weight.

On a CPU without AMX or AVX512-BF16 a bf16 matmul is emulated (100–300× slower), so a LoRA run
computes in fp32; its frozen base can still be stored in bf16, the dtype Llama-3's files hold,
at half the bytes. Each call converts the weight to fp32 for its one matmul. Plain
`F.linear(x, w.float())` would do that too, but autograd would keep every layer's fp32 copy
until the backward: the whole base in fp32 again. Here the backward converts the saved bf16
weight a second time instead (conversion costs one pass over the weight's bytes, against the
2·tokens passes of its matmul). No weight gradient exists: the base is frozen.

The fp32 copy of bf16 values is exact, so the result is the fp32-stored base's
(tests/unit/test_lora.py compares losses and gradients).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


class _UpcastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(weight)
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = grad_out @ weight.to(grad_out.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` for a frozen `weight` (and bias) stored in a narrower dtype than `x`: computed in
    x's dtype; only the stored weight is kept for the backward."""
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("upcast_linear is for frozen weights: it computes no weight gradient")
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    return _UpcastLinear.apply(x, weight, bias)
