"""The smallest cluster whose nodes hold every rank's plan.

A node gives pods its memory minus what the kubelet, the system and the eviction threshold
keep (EKS reserves roughly 1 GiB plus a few percent); ranks need a physical core each at least.
Among the layouts that fit — nodes × ranks per node = world size — the smallest is the one
with the least memory in total, then the fewest nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.errors import ConfigError
from cputrain.plan.instances import Instance

GIB = 2**30
NODE_RESERVED_GIB = 1.0  # kubelet + system daemons
NODE_RESERVED_FRACTION = 0.05  # eviction threshold and kernel
POD_HEADROOM = 1.10  # requests are the plan plus 10%: allocator fragmentation, page cache of mmaps


@dataclass(frozen=True)
class ClusterFit:
    instance: Instance
    nnodes: int
    nproc_per_node: int
    pod_memory_bytes: int  # what each pod requests (plan × headroom)
    allocatable_gib: float

    @property
    def total_memory_gib(self) -> float:
        return self.nnodes * self.instance.memory_gib


def allocatable_gib(inst: Instance) -> float:
    return inst.memory_gib * (1 - NODE_RESERVED_FRACTION) - NODE_RESERVED_GIB


def pod_memory_bytes(rank_peak_bytes: int, nproc_per_node: int) -> int:
    return int(rank_peak_bytes * nproc_per_node * POD_HEADROOM)


def fits(inst: Instance, rank_peak_bytes: int, nproc_per_node: int, pod_extra_bytes: int = 0) -> bool:
    """`pod_extra_bytes`: what a pod holds besides its ranks (a memory-backed /dev/shm)."""
    return (pod_memory_bytes(rank_peak_bytes, nproc_per_node) + pod_extra_bytes <= allocatable_gib(inst) * GIB
            and nproc_per_node <= inst.physical_cores)


def smallest_cluster(instances: list[Instance], rank_peak_bytes: int, world_size: int,
                     nproc_per_node: int | None = None, pod_extra_bytes: int = 0) -> ClusterFit:
    """The cheapest layout in memory; `nproc_per_node` fixes the ranks per node when given."""
    layouts = [nproc_per_node] if nproc_per_node else [p for p in range(1, world_size + 1) if world_size % p == 0]
    if nproc_per_node and world_size % nproc_per_node:
        raise ConfigError(f"world size {world_size} is not a multiple of --nproc-per-node {nproc_per_node}")
    options = [
        ClusterFit(inst, world_size // p, p, pod_memory_bytes(rank_peak_bytes, p), allocatable_gib(inst))
        for inst in instances
        for p in layouts
        if fits(inst, rank_peak_bytes, p, pod_extra_bytes)
    ]
    if not options:
        largest = max(instances, key=allocatable_gib)
        per_rank = rank_peak_bytes * POD_HEADROOM / GIB
        raise ConfigError(
            f"world size {world_size}: each rank needs {per_rank:.1f} GiB and no instance in the table holds "
            f"{'that many ranks' if nproc_per_node else 'one'} (largest: {largest.name}, "
            f"{allocatable_gib(largest):.0f} GiB allocatable); raise the world size with a sharding strategy "
            "(fsdp or zero3), turn on model.activation_checkpointing, or pass --instances-file with bigger nodes"
        )
    return min(options, key=lambda f: (f.total_memory_gib, f.nnodes, f.instance.vcpus, f.instance.name))
