"""DDP's replicas start equal without a broadcast, and are proven equal by a fingerprint.

DistributedDataParallel broadcasts rank 0's weights when it is built: the whole model to every
rank (16 GB each for an 8B base, across nodes), for weights every rank has just read from the
same files or drawn from the same seed. cputrain builds it without that sync (init_sync=False)
and instead compares a CRC-32 of every parameter and buffer across ranks: a few hundred numbers
on the wire. A rank whose weights differ (a model folder that is another copy on its node, a
file that changed) refuses to start, naming the first tensor that differs, rather than train
replicas that silently drift apart.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from cputrain.distributed import process_group as pg
from cputrain.errors import ModelError


def _crc(tensor: torch.Tensor) -> int:
    data = tensor.detach().reshape(-1).contiguous().view(torch.uint8)  # the bytes, whatever the dtype
    return zlib.crc32(memoryview(data.numpy()))  # zlib releases the GIL: tensors hash in parallel


def fingerprint(module: nn.Module) -> tuple[list[str], list[int]]:
    """(names, one CRC-32 per parameter and buffer): exact, so any flipped bit shows."""
    tensors = [(name, t) for name, t in module.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)]
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as pool:
        crcs = list(pool.map(lambda item: _crc(item[1]), tensors))
    return [name for name, _ in tensors], crcs


def check_replicas_agree(module: nn.Module, what: str) -> None:
    """Every rank's weights equal rank 0's, or every rank raises the same one-line error."""
    names, crcs = fingerprint(module)
    # One collective: every rank gets every rank's list and comes to the same verdict.
    report = pg.all_gather_objects((os.uname().nodename, crcs))
    reference = report[0][1]
    for other, (host, theirs) in enumerate(report):
        differ = [name for name, crc, ref in zip(names, theirs, reference) if crc != ref]
        if len(theirs) != len(reference):  # another model altogether
            differ.append(f"{len(theirs)} tensors there, {len(reference)} on rank 0")
        if differ:
            raise ModelError(f"rank {other} (host {host}) holds other weights than rank 0 after {what}: {len(differ)} "
                             f"tensor(s) differ (first: '{differ[0]}'); every rank must read the same files: check "
                             "that model.name_or_path is the same copy on every node")
