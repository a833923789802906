"""Which cores each rank gets: disjoint sets, whole NUMA nodes (or sockets) where they divide.

torchrun gives every rank OMP_NUM_THREADS=1, so 4 ranks on a 32-core node use 4 cores. Here
each of the node's ranks gets cores ÷ ranks threads, pinned to its own cores, so ranks never
fight over a core and each keeps its memory on its own NUMA node.
"""

from __future__ import annotations

from cputrain.config import Config
from cputrain.hardware import HardwareFacts


def core_sets(hw: HardwareFacts, local_world_size: int) -> list[list[int]]:
    """One list of CPU ids per local rank. Cores are ordered NUMA node by NUMA node, so an even
    split keeps each rank inside one node whenever ranks ≤ nodes or nodes divide evenly."""
    cpus = [c.cpu for c in hw.cores]  # already sorted by (numa node, socket, cpu)
    per_rank = max(1, len(cpus) // local_world_size)
    sets = []
    for r in range(local_world_size):
        chunk = cpus[r * per_rank : (r + 1) * per_rank]
        sets.append(chunk or [cpus[r % len(cpus)]])  # more ranks than cores: share, round robin
    return sets


def cpus_for_rank(hw: HardwareFacts, local_rank: int, local_world_size: int, cfg: Config) -> list[int] | None:
    if local_world_size == 1 and cfg.hardware.threads == hw.physical_cores:
        return None  # one rank owning the machine: leave the scheduler free (and hyper-threads usable)
    return core_sets(hw, local_world_size)[local_rank][: max(1, int(cfg.hardware.threads))] or None
