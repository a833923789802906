"""The warm-up + cosine learning-rate schedule (cputrain.training.lr_schedule), over AdamW."""

from __future__ import annotations

import math

import pytest
from torch import nn

from cputrain.config import TrainConfig
from cputrain.parallel.adamw import build_adamw
from cputrain.training.lr_schedule import build_schedule, lr_factor


def test_warmup_is_linear_then_cosine_to_min_ratio():
    warm, total, floor = 4, 20, 0.1
    factors = [lr_factor(s, warm, total, floor) for s in range(total + 3)]
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert factors[4] == pytest.approx(1.0)
    middle = warm + (total - warm) // 2
    assert factors[middle] == pytest.approx(floor + (1 - floor) * 0.5)
    assert factors[total] == pytest.approx(floor) and factors[-1] == pytest.approx(floor)
    decay = factors[warm:total + 1]
    assert all(a >= b for a, b in zip(decay, decay[1:]))  # never rises after warm-up


def test_no_warmup_starts_at_peak():
    assert lr_factor(0, 0, 10, 0.0) == pytest.approx(1.0)
    assert lr_factor(5, 0, 10, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_schedule_drives_the_optimizer_and_restores():
    model = nn.Linear(4, 4)
    cfg = TrainConfig(lr=1e-2, warmup_steps=2, max_steps=10, min_lr_ratio=0.0)
    opt = build_adamw(model, cfg)
    sched = build_schedule(opt, cfg, total_steps=10)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:3] == pytest.approx([5e-3, 1e-2, 1e-2])
    state = sched.state_dict()
    opt2 = build_adamw(model, cfg)
    sched2 = build_schedule(opt2, cfg, total_steps=10)
    sched2.load_state_dict(state)
    assert sched2.get_last_lr() == pytest.approx(sched.get_last_lr())


def test_a_new_peak_lr_continues_the_same_shape_from_the_step_it_is_at():
    """What a resumed run with another train.lr asks of the schedule (its own method, not
    attributes written from outside): from step 3 on, the lrs of a schedule built with the new
    peak from the start, also after a save and load of its state."""
    model = nn.Linear(4, 4)
    old, new = (TrainConfig(lr=lr, warmup_steps=2, max_steps=10, min_lr_ratio=0.1) for lr in (1e-2, 4e-3))
    opt = build_adamw(model, old)
    sched = build_schedule(opt, old, total_steps=10)
    reference = build_schedule(build_adamw(model, new), new, total_steps=10)
    for _ in range(3):
        for schedule in (sched, reference):
            schedule.optimizer.step()  # the order torch expects (no gradients: nothing moves)
            schedule.step()
    sched.set_peak_lr(4e-3)
    assert sched.peak_lr == 4e-3
    loaded = build_schedule(build_adamw(model, old), old, total_steps=10)
    loaded.load_state_dict(sched.state_dict())
    for _ in range(5):
        assert sched.get_last_lr() == pytest.approx(reference.get_last_lr())
        assert opt.param_groups[0]["lr"] == pytest.approx(reference.get_last_lr()[0])
        assert loaded.get_last_lr() == pytest.approx(reference.get_last_lr())
        for schedule in (sched, reference, loaded):
            schedule.optimizer.step()
            schedule.step()
