"""The warm-up + cosine learning-rate schedule. It owns its state: a resumed run with another
peak lr asks the schedule to change it (set_peak_lr)."""

from __future__ import annotations

import math

import torch

from cputrain.config import TrainConfig


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
