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
    # torch.distributed.nn.functional binds `group=group.WORLD` as a default argument of its
    # functions when it is first imported (DDP imports it). Imported after the group exists,
    # it would hold the group for the life of the interpreter; then the group's gloo threads
    # outlive destroy() and die in interpreter teardown, where a thread that reaches for the
    # GIL aborts the rank (SIGABRT, "terminate called without an active exception").
    import torch.distributed.nn  # noqa: F401
    timeout = datetime.timedelta(seconds=timeout_s)
    if world_size == 1:
        # ddp/fsdp/zero3 on one rank still call collectives: give them a group of one, on an
        # in-memory store, so no port is opened (and none can clash with another run).
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    store = agent_store_of_this_round(world_size, timeout)
    if store is not None:
        dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]), world_size=world_size,
                                timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout)


def agent_store_of_this_round(world_size: int, timeout: datetime.timedelta,
                              environ: dict | None = None) -> dist.Store | None:
    """Under the torchrun agent: its store, seen through a prefix of this restart round.

    The agent keeps one store for every round after a restart, and torch's env:// rendezvous
    connects the ranks to it with no prefix, so the gloo group of a restarted round finds the
    addresses the previous round's ranks published under the same keys: it dials a dead rank
    ("Gloo connectFullMesh failed ... Connection refused") or waits forever (seen in about half
    the restarts after a SIGKILL here). Keys under the round's own prefix cannot be stale.
    """
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # rank 0 hosts a fresh store for this process group (mpirun, opt-out)
    round_ = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"cputrain/restart-{round_}", client)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_from_main(value):
    """Rank 0's `value` (any picklable object) on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(value) -> list:
    """Every rank's `value` (any picklable object), in rank order, on every rank."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def all_reduce_mean(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item() / dist.get_world_size())


def all_reduce_sum(values: list[float]) -> list[float]:
    """The sums over ranks of a few numbers, in one collective."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def destroy() -> None:
    """Destroy the process group while the interpreter is whole. The caller drops what holds the
    group first (the wrapped model, the optimizer); gc.collect() frees any reference cycles among
    them, so the group's threads are joined here rather than in interpreter teardown."""
    import gc

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def collective_threads() -> list[str]:
    """Names of this process's threads that a process group runs (gloo's loops), from the OS."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return []
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if "gloo" in name or "ccl" in name:
            names.append(name)
    return names


def exit_without_teardown(code: int = 0) -> None:
    """End this rank now, skipping interpreter teardown (the run's files are all written).

    For when a library still holds the destroyed group (FSDP2's DTensor caches keep its device
    mesh; DeepSpeed keeps its groups in module globals): its gloo threads would then meet the
    interpreter's teardown, where one that reaches for the GIL aborts the rank with SIGABRT
    after a finished run, and the agent reports the whole run as failed."""
    import logging
    import sys

    for handler in logging.getLogger("cputrain").handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
