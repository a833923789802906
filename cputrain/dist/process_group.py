"""The process group for several ranks, and this rank's threads and cores."""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("cputrain")


def set_threads(threads: int, cpus: list[int] | None) -> None:
    """Use `threads` compute threads, on `cpus` if given (so ranks don't share cores)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    # torchrun sets OMP_NUM_THREADS=1 for every rank; set_num_threads overrides it at run time.
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def init_process_group(backend: str, world_size: int, timeout_s: int = 600) -> None:
    if dist.is_initialized():
        return
    if backend == "ccl":
        import oneccl_bindings_for_pytorch  # noqa: F401  registers the backend
    timeout = datetime.timedelta(seconds=timeout_s)
    if world_size == 1:
        # ddp/fsdp/zero3 on one rank still call collectives: give them a group of one, on an
        # in-memory store, so no port is opened (and none can clash with another run).
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_mean(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item() / dist.get_world_size())


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
