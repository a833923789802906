"""Which cores each rank gets: disjoint sets, whole NUMA nodes (or sockets) where they divide.

torchrun gives every rank OMP_NUM_THREADS=1, so 4 ranks on a 32-core node use 4 cores. Here
each of the node's ranks gets cores ÷ ranks threads, pinned to its own cores, so ranks never
fight over a core and each keeps its memory on its own NUMA node.
"""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.config import Config
from cputrain.hardware import Core, HardwareFacts


@dataclass(frozen=True)
class CoreSets:
    sets: list[list[int]]  # CPU ids per local rank
    reason: str


def _group_split(cores: list[Core], key: str, ranks: int) -> list[list[int]] | None:
    """Whole groups (NUMA nodes or sockets) per rank when the groups divide evenly among ranks,
    or an equal share of one group per rank when the ranks divide evenly among the groups."""
    groups: dict[int, list[int]] = {}
    for c in cores:
        groups.setdefault(getattr(c, key), []).append(c.cpu)
    ordered = [groups[g] for g in sorted(groups)]
    n = len(ordered)
    if n < 2:
        return None
    if ranks <= n and n % ranks == 0:
        per = n // ranks
        return [sum(ordered[r * per : (r + 1) * per], []) for r in range(ranks)]
    if ranks > n and ranks % n == 0:
        per_group = ranks // n
        sets = []
        for cpus in ordered:
            share = len(cpus) // per_group
            if share == 0:
                return None
            sets.extend(cpus[i * share : (i + 1) * share] for i in range(per_group))
        return sets
    return None


def core_sets(hw: HardwareFacts, local_world_size: int) -> CoreSets:
    """One list of CPU ids per local rank, with the reason for the split."""
    ranks = max(1, local_world_size)
    for key, label in (("numa_node", "NUMA node"), ("socket", "socket")):
        sets = _group_split(hw.cores, key, ranks)
        if sets is not None:
            return CoreSets(sets, f"{ranks} rank(s) over {len({getattr(c, key) for c in hw.cores})} {label}s: "
                                  f"each rank stays inside its {label}(s)")
    cpus = [c.cpu for c in hw.cores]  # sorted by (numa node, socket, cpu)
    if ranks > len(cpus):
        # More ranks than cores: they must share; round robin keeps the sharing even.
        return CoreSets([[cpus[r % len(cpus)]] for r in range(ranks)],
                        f"{ranks} ranks on {len(cpus)} cores: ranks share cores round robin (slow; use fewer ranks)")
    per_rank = len(cpus) // ranks
    sets = [cpus[r * per_rank : (r + 1) * per_rank] for r in range(ranks)]
    spare = len(cpus) - per_rank * ranks
    why = f"{len(cpus)} physical cores ÷ {ranks} rank(s) = {per_rank} contiguous cores each"
    if spare:
        why += f" ({spare} core(s) left idle so every rank gets the same share)"
    return CoreSets(sets, why)


def cpus_for_rank(hw: HardwareFacts, local_rank: int, local_world_size: int, cfg: Config) -> list[int] | None:
    if local_world_size == 1 and cfg.hardware.threads == hw.physical_cores:
        return None  # one rank owning the machine: leave the scheduler free (and hyper-threads usable)
    mine = core_sets(hw, local_world_size).sets[local_rank]
    return mine[: cfg.hardware.threads] or None
