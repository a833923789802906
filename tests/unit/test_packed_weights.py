"""The decode step's weights reordered once (cputrain.rollouts.packed_weights): a reordered weight
multiplies as the dense one, with and without a bias, for any number of rows. In bf16 (where oneDNN
runs bf16 here) bit for bit; in fp32 to fp32's rounding, oneDNN summing in another order than MKL."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cputrain.rollouts.packed_weights import for_products, linear, reorders

ROWS = [(1,), (7,), (64, 1), (3, 40)]


def _weight_bias_input(dtype: torch.dtype, rows: tuple[int, ...]):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=generator).to(dtype)
    bias = torch.randn(48, generator=generator).to(dtype)
    return weight, bias, torch.randn(*rows, 32, generator=generator).to(dtype)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", ROWS)
def test_a_reordered_fp32_weight_multiplies_as_the_dense_one(rows):
    weight, bias, x = _weight_bias_input(torch.float32, rows)
    packed = for_products(weight)
    assert reorders(torch.float32) and packed.is_mkldnn and packed.shape == weight.shape
    torch.testing.assert_close(linear(x, packed, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, packed, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_a_weight_left_as_it_is_multiplies_as_f_linear():
    weight, bias, x = _weight_bias_input(torch.float64, (3,))  # no dtype oneDNN reorders
    assert not reorders(torch.float64) and for_products(weight) is weight
    assert torch.equal(linear(x, weight, bias), F.linear(x, weight, bias))


@pytest.mark.skipif(not reorders(torch.bfloat16), reason="oneDNN does not run bf16 on this CPU")
@pytest.mark.parametrize("rows", ROWS)
def test_a_reordered_bf16_weight_multiplies_as_the_dense_one(rows):
    weight, bias, x = _weight_bias_input(torch.bfloat16, rows)
    packed = for_products(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    assert torch.equal(linear(x, packed, bias), F.linear(x, weight, bias))
    assert torch.equal(linear(x, packed, None), F.linear(x, weight))
