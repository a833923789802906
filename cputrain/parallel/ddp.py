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

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

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
    metered = True

    def wrap(self, model: nn.Module) -> nn.Module:
        materialize(model)
        if self.ctx.cfg.model.name_or_path is None:
            # Initialise now, exactly as the single strategy does (init, then tie): initialising
            # after tying would draw the shared embedding twice and start from other weights.
            # DDP broadcasts rank 0's parameters as it is built, so they must exist by then.
            random_init(model, self.ctx.cfg.seed)
        else:
            model.tie_weights()  # to_empty unties shared parameters; DDP must see the tied set
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, _metered_allreduce_hook)
        return ddp

    def load_weights(self, model: nn.Module, folder: Path | None) -> None:
        # Every rank fills the same values (the same file; or the seed, drawn at wrap time), so
        # replicas agree without a second broadcast.
        if folder is not None:
            load_into(model.module, folder, file_name_of=self.ctx.file_name_of)

    def accumulation(self, model: nn.Module, last_micro_batch: bool):
        return contextlib.nullcontext() if last_micro_batch else model.no_sync()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module


def build(ctx: StrategyContext) -> Strategy:
    return DDPStrategy(ctx)
