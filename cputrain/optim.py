"""AdamW with decay on matrices only, and the warm-up + cosine learning-rate schedule.

Every strategy builds its AdamW here (ZeRO-3 from its partitions' groups), and the schedule owns
its state: a resumed run with another peak lr asks the schedule to change it (set_peak_lr).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from cputrain.config import TrainConfig


def decay_groups(params, weight_decay: float, ndim: Callable[[torch.Tensor], int] = torch.Tensor.dim) -> list[dict]:
    """Two parameter groups: matrices with weight decay, the rest without. `ndim` gives a
    parameter's own dimensions (ZeRO-3 reads them from ds_shape: a partition's tensor is flat)."""
    # Norm gains and biases are 1-D: decaying them toward zero only hurts (nanoGPT, GPT-3).
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if ndim(p) >= 2]
    no_decay = [p for p in params if ndim(p) < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    return adamw(decay_groups(model.parameters(), cfg.weight_decay), cfg)


def adamw(groups: list[dict], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The AdamW of train.* over parameter groups (decay_groups)."""
    # fused: one kernel per parameter that reads and writes each of param, grad and both moments
    # once (foreach makes a pass per arithmetic op, with temporaries of a group's size). Measured
    # on a 97M Llama in bf16 on AMX: +3% tokens/s (benchmarks/bf16_step.py); in fp32 on an AVX2
    # EPYC within noise of foreach (0.97–1.01×, benchmarks/fp32_choices.py), so it is kept for
    # both precisions. Same update rule; CPU support since torch 2.4.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at `step` (0-based): linear warm-up, then cosine down to min_ratio."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupCosine(torch.optim.lr_scheduler.LambdaLR):
    """torch's LambdaLR on lr_factor (its state_dict, so checkpoints stay as they were), plus the
    one change a resumed run may ask of it: another peak lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
        super().__init__(optimizer, lambda step: lr_factor(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio))

    @property
    def peak_lr(self) -> float:
        return self.base_lrs[0]

    def set_peak_lr(self, lr: float) -> None:
        """The same warm-up + cosine shape, from the step it is at, with peak `lr`."""
        self.base_lrs = [lr] * len(self.base_lrs)
        for group, factor_of in zip(self.optimizer.param_groups, self.lr_lambdas):
            group["initial_lr"] = lr  # what a LambdaLR built on this optimizer again would read
            group["lr"] = lr * factor_of(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


def build_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int) -> WarmupCosine:
    return WarmupCosine(optimizer, cfg, total_steps)
