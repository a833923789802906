"""The decode step's bf16 weight matrices in oneDNN's blocked layout, reordered once per rollout.

Why: a decode step multiplies a few dozen rows by each weight. torch's bf16 linear reorders the
weight into oneDNN's blocked layout on every call; a weight reordered once skips that. At the demo's
size (64 rows, 2 threads, AVX512-BF16) the step's products took 1.58 ms against 2.18 ms, at ~100M
26.9 against 30.0 ms, the results bit for bit the same; reordering ~100M's weights once took 0.1 s.
The same for fp32 (MKL's packed weights) gave nothing measurable, so fp32 weights stay as they are.

A reordered weight is an opaque oneDNN tensor: it is only multiplied (linear() below), never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reorders(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` are reordered here: bf16 where oneDNN runs bf16 on this CPU."""
    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def for_products(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out × in) as linear() multiplies it fastest: reordered where reorders() says, else itself."""
    if not reorders(weight.dtype):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 64)  # the rows hint changes nothing measured


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear over a weight from for_products()."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
