"""The decode step's weight matrices in oneDNN's blocked layout, reordered once per rollout.

Why: a decode step multiplies a few dozen rows by each weight, a shape at which the general
products are slow to start.
- bf16: torch's bf16 linear reorders the weight into oneDNN's blocked layout on every call; a weight
  reordered once skips that. At the demo's size (64 rows, 2 threads, AVX512-BF16) the step's products
  took 1.58 ms against 2.18 ms, at ~100M 26.9 against 30.0 ms, the results bit for bit the same;
  reordering ~100M's weights once took 0.1 s.
- fp32: torch's fp32 linear is MKL's, which at 64 rows runs well below its large-product rate where
  the output is wide (the gate-up product, the head). oneDNN's product on a reordered weight, at 64
  rows, 2 threads, an AVX2-only EPYC: 1.29× MKL's over one of each of the demo's products and 1.36×
  over ~100M's (the head 1.39× and 1.58×), in each of 6 alternated rounds. MKL's own packed weights
  gave nothing measurable. oneDNN sums in another order than MKL: the results agree to fp32's
  rounding, not bit for bit.

The cost is memory: a reordered weight is a copy, so in fp32 the rollout holds every projection and
the head twice, which the memory plan counts (fused_weight_size.py).

A reordered weight is an opaque oneDNN tensor: it is only multiplied (linear() below), never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reorders(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` are reordered here: fp32 where torch has oneDNN, bf16 where oneDNN
    also runs bf16 on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


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
