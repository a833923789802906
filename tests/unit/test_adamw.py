"""AdamW's parameter groups (cputrain.parallel.adamw) and the optimizer step a strategy takes with it:
clipping, and a non-finite step that leaves weights and moments alone."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cputrain.config import TrainConfig
from cputrain.parallel.adamw import build_adamw


def test_weight_decay_only_on_matrices():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2, bias=False))
    cfg = TrainConfig(weight_decay=0.1, beta1=0.8, beta2=0.9)
    opt = build_adamw(model, cfg)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.dim() for p in decay["params"]} == {2}
    assert {p.dim() for p in no_decay["params"]} == {1}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert decay["betas"] == (0.8, 0.9)


def test_clipping_bounds_the_update():
    # grad_clip goes through the strategy; the single strategy clips with torch's own clip_grad_norm_.
    from cputrain.config import Config
    from cputrain.parallel.base import StrategyContext
    from cputrain.parallel.single import SingleStrategy

    model = nn.Linear(3, 1, bias=False)
    model.weight.grad = torch.full_like(model.weight, 10.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = model.weight.detach().clone()
    strategy = SingleStrategy(StrategyContext(Config(), 0, 1, torch.float32))
    norm, stepped = strategy.step(model, opt, grad_clip=1.0)
    assert stepped
    assert norm == pytest.approx(10.0 * math.sqrt(3))
    assert torch.linalg.vector_norm(model.weight - before).item() == pytest.approx(1.0, rel=1e-4)
    assert model.weight.grad is None


@pytest.mark.parametrize("grad_value, loss_finite", [(float("nan"), True), (float("inf"), True), (1.0, False)])
def test_a_non_finite_step_leaves_weights_and_moments_alone(grad_value, loss_finite):
    from cputrain.config import Config
    from cputrain.parallel.base import StrategyContext
    from cputrain.parallel.single import SingleStrategy

    model = nn.Linear(3, 1, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model.weight.grad = torch.ones_like(model.weight)
    strategy = SingleStrategy(StrategyContext(Config(), 0, 1, torch.float32))
    assert strategy.step(model, opt, grad_clip=1.0)[1]  # a finite step first: AdamW has moments
    weight, moments = model.weight.detach().clone(), {k: v.clone() for k, v in opt.state[model.weight].items()}
    model.weight.grad = torch.full_like(model.weight, grad_value)
    norm, stepped = strategy.step(model, opt, grad_clip=1.0, loss_finite=loss_finite)
    assert not stepped
    assert math.isfinite(norm) == (grad_value == 1.0)
    assert torch.equal(model.weight, weight)
    for key, value in opt.state[model.weight].items():
        assert torch.equal(value, moments[key]), key
    assert model.weight.grad is None  # the bad gradient does not leak into the next step
