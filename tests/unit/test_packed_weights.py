"""The decode step's weights reordered once (cputrain.rollouts.packed_weights): in bf16, where oneDNN
runs bf16 here, a reordered weight multiplies as the dense one, bit for bit, with and without a
bias, for any number of rows; fp32 weights are left as they are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cputrain.rollouts.packed_weights import for_products, linear, reorders


def test_fp32_weights_are_multiplied_as_they_are():
    weight = torch.randn(24, 16)
    assert not reorders(torch.float32) and for_products(weight) is weight
    x = torch.randn(3, 16)
    assert torch.equal(linear(x, weight, None), F.linear(x, weight))


@pytest.mark.skipif(not reorders(torch.bfloat16), reason="oneDNN does not run bf16 on this CPU")
@pytest.mark.parametrize("rows", [(1,), (7,), (64, 1), (3, 40)])
def test_a_reordered_bf16_weight_multiplies_as_the_dense_one(rows):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator).bfloat16()
    bias = torch.randn(48, generator=generator).bfloat16()
    packed = for_products(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    x = torch.randn(*rows, 32, generator=generator).bfloat16()
    assert torch.equal(linear(x, packed, bias), F.linear(x, weight, bias))
    assert torch.equal(linear(x, packed, None), F.linear(x, weight))
