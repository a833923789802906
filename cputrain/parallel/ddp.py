"""DDP: every rank holds the whole model; gradients are averaged with one all-reduce per bucket.

DistributedDataParallel is built without its start-up broadcast of rank 0's weights
(init_sync=False): every rank fills the same weights itself (load_weights: the same files, or
the same seed) and a fingerprint proves it (parallel.replica_check). Gradient accumulation skips the all-reduce
on every micro-batch but the last (no_sync), so one step costs one all-reduce whatever the
accumulation.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cputrain.model import load_into, materialize, random_init, safetensors_files
from cputrain.parallel.base import Strategy, StrategyContext
from cputrain.parallel.file_reads import PlainReads
from cputrain.parallel.replica_check import check_replicas_agree


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
    # With gradient_as_bucket_view each .grad is a view of DDP's flat buckets. Where a step
    # accumulates, gradients set to None after a step leave the buckets allocated, and the
    # micro-batches under no_sync build fresh gradients beside them until the synced one copies
    # them in: two copies of the gradients for most of the step. Zeroed in place they stay the
    # buckets. Without accumulation None costs nothing (each fresh gradient is copied into its
    # bucket and freed as it arrives), and zeroed views would cost a copy once: DDP rebuilds its
    # buckets in the order gradients arrived before the second step's forward, and views of the
    # old buckets keep them alive beside the new (measured: +0.27 GiB a rank at ~88M, seq 32).
    _accumulates = False

    @property
    def grads_to_none(self) -> bool:
        return not self._accumulates

    def wrap(self, model: nn.Module) -> nn.Module:
        materialize(model)
        if self.ctx.cfg.model.name_or_path is None:
            # Initialise now, exactly as the single strategy does (init, then tie): initialising
            # after tying would draw the shared embedding twice and start from other weights.
            random_init(model, self.ctx.cfg.seed)
        else:
            model.tie_weights()  # to_empty unties shared parameters; DDP must see the tied set
        # No start-up broadcast: each rank has (or will read) the same weights; load_weights checks.
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, init_sync=False)
        ddp.register_comm_hook(None, _metered_allreduce_hook)
        return ddp

    def load_weights(self, model: nn.Module, folder: Path | None) -> None:
        # Every rank fills the same values (the same file; or the seed, drawn at wrap time), so
        # replicas agree without a broadcast: the fingerprint proves it.
        if folder is not None:
            with PlainReads(safetensors_files(folder)) as files:  # no mapped second copy (file_reads)
                load_into(model.module, folder, copy_fn=files.copy_whole, file_name_of=self.ctx.file_name_of)

    def check_weights(self, model: nn.Module) -> None:
        cfg = self.ctx.cfg
        source = f"reading {cfg.model.name_or_path}" if cfg.model.name_or_path else f"the random init (seed {cfg.seed})"
        check_replicas_agree(model.module, source)

    def accumulation(self, model: nn.Module, last_micro_batch: bool):
        if last_micro_batch:
            return contextlib.nullcontext()
        self._accumulates = True  # a step of several micro-batches: zero the gradients in place
        return model.no_sync()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module


def build(ctx: StrategyContext) -> Strategy:
    return DDPStrategy(ctx)
