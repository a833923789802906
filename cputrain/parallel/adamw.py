"""AdamW with decay on matrices only: every strategy builds its optimizer here (ZeRO-3 from its
partitions' groups)."""

from __future__ import annotations

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
