"""DDP: every rank holds the whole model; gradients are averaged with one all-reduce per bucket.

DistributedDataParallel broadcasts rank 0's parameters when it is built, so the skeleton is
materialized at wrap time (a replica needs the whole model anyway) and the weights are then
filled identically on every rank by load_weights. Gradient accumulation skips the all-reduce
on every micro-batch but the last (no_sync), so one step costs one all-reduce whatever the
accumulation.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cputrain.distributed.comm import CommMeter, summarize
from cputrain.model import load_into, materialize, random_init
from cputrain.parallel.base import Strategy, StrategyContext


def _metered_allreduce_hook(_state, bucket):
    """DDP's default averaging all-reduce, issued through torch.distributed so the meter sees it.
    (No annotations: DDP checks them at run time and this module's are postponed strings.)"""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        self.meter = CommMeter.install()

    def wrap(self, model: nn.Module) -> nn.Module:
        materialize(model)
        if self.ctx.cfg.model.name_or_path is None:
            # Initialise now, exactly as the single strategy does (init, then tie): initialising
            # after tying would draw the shared embedding twice and start from other weights.
            random_init(model, self.ctx.cfg.seed)
        else:
            model.tie_weights()  # to_empty unties shared parameters; DDP must see the tied set
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, _metered_allreduce_hook)
        return ddp

    def load_weights(self, model: nn.Module, folder: Path | None, seed: int) -> None:
        # Every rank fills the same values (same file, or the seed at wrap time), so replicas
        # agree without a second broadcast.
        if folder is not None:
            load_into(model.module, folder)
        elif seed != self.ctx.cfg.seed:
            random_init(model.module, seed)

    def accumulation(self, model: nn.Module, last_micro_batch: bool):
        return contextlib.nullcontext() if last_micro_batch else model.no_sync()

    def comm_stats(self) -> dict:
        return self.meter.window()

    def comm_summary(self, rows: list[dict]) -> dict:
        return summarize(rows)

    def save(self, model, optimizer, path: str) -> None:
        with self.meter.suspended():
            super().save(model, optimizer, path)

    def full_state_dict(self, model: nn.Module):
        with self.meter.suspended():
            yield from model.module.state_dict().items()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module

    def close(self) -> None:
        self.meter.uninstall()


def build(ctx: StrategyContext) -> Strategy:
    return DDPStrategy(ctx)
