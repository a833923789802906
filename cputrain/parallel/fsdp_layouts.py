"""FSDP2's layouts: where parameters are sharded and how often they cross the network.

On CPUs over Ethernet nothing hides a collective behind compute (FSDP2 has no side stream on CPU,
and gloo's threads take cores from the matmuls), so the bytes a step sends are what its layout
chooses. Each layout is FSDP2's own documented knobs, set at wrap time and per micro-batch:

    full_shard    every block sharded over all ranks, gathered for each micro-batch's forward
                  and again for its backward (FSDP2's default)
    node_reshard  after the forward a block keeps the node's share (reshard_after_forward = ranks
                  per node): the backward's gather stays inside the node
    gather_once   blocks gathered once per optimizer step and kept across its micro-batches;
                  gradients accumulate unsharded and are reduce-scattered once, after the last
    hybrid        sharded within a node, replicated across nodes (HSDP, a 2-D device mesh):
                  gathers and reduce-scatters stay in the node; the gradient shards are
                  all-reduced across nodes once per step, after the last micro-batch

In every layout the root (embeddings, final norm, head) stays gathered from the step's first
forward to its last backward (its gradients are still reduced every micro-batch, except under
gather_once): it is gathered once per step instead of once per micro-batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from cputrain.errors import ConfigError

LAYOUTS = ("full_shard", "node_reshard", "gather_once", "hybrid")


def layout_error(layout: str, world_size: int, ranks_per_node: int) -> str | None:
    """Why `layout` cannot run on `world_size` ranks, `ranks_per_node` to a node (None: it can)."""
    if layout not in LAYOUTS:
        return f"parallel.layout={layout} is not a layout; choose one of {', '.join(LAYOUTS)} (or auto)"
    if ranks_per_node < 1 or world_size % ranks_per_node:
        return (f"{world_size} ranks do not divide into nodes of {ranks_per_node}: every node must run the same "
                "number of ranks (--nproc-per-node)")
    nodes = world_size // ranks_per_node
    if layout == "node_reshard" and (ranks_per_node < 2 or nodes < 2):
        return (f"parallel.layout=node_reshard keeps a node's share after the forward: it needs 2 or more nodes of 2 "
                f"or more ranks (here {nodes} node(s) of {ranks_per_node}); use full_shard or gather_once")
    if layout == "hybrid" and nodes < 2:
        return ("parallel.layout=hybrid replicates across nodes: on one node it is full_shard; use full_shard "
                "(or run on 2 or more nodes)")
    return None


@dataclass(frozen=True)
class Layout:
    """What fully_shard is called with, and what each micro-batch toggles."""

    name: str
    world_size: int
    ranks_per_node: int

    def check(self) -> None:
        error = layout_error(self.name, self.world_size, self.ranks_per_node)
        if error:
            raise ConfigError(error)

    def mesh(self):
        """The device mesh the blocks are sharded on: None (FSDP2's default, every rank) or, for
        hybrid, nodes × ranks per node (replicate across the first dimension, shard along the second).
        Ranks are node-contiguous (torchrun numbers a node's ranks together)."""
        if self.name != "hybrid":
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", (self.world_size // self.ranks_per_node, self.ranks_per_node),
                                mesh_dim_names=("replicate", "shard"))

    def block_reshard_after_forward(self) -> bool | int:
        if self.name == "node_reshard":
            return self.ranks_per_node
        return self.name != "gather_once"

    def wrap_context(self):
        """node_reshard: the blocks share one post-forward mesh (see one_post_forward_mesh)."""
        return one_post_forward_mesh() if self.name == "node_reshard" else contextlib.nullcontext()

    def before_micro_batch(self, model: nn.Module, last: bool) -> None:
        """Set FSDP2's per-step toggles for the coming forward and backward: keep parameters
        gathered (and, where the layout says, gradients unreduced) until the step's last backward."""
        model.set_reshard_after_backward(last, recurse=self.name == "gather_once")
        if self.name == "gather_once":
            model.set_requires_gradient_sync(last)
        elif self.name == "hybrid":
            model.set_requires_all_reduce(last)


@contextlib.contextmanager
def one_post_forward_mesh():
    """fully_shard(reshard_after_forward=N) builds a new N-rank device mesh, and with it new process
    groups, for every module it wraps: 33 meshes (66 gloo groups, each a rendezvous and a set of
    connections) for a 32-block Llama. Every block reshards to the same node-sized groups, so within
    this context one mesh is made per (size, ranks) and handed to all of them."""
    try:
        from torch.distributed.fsdp._fully_shard import _fully_shard as fully_shard_module
        original = fully_shard_module._get_post_forward_mesh_info
    except (ImportError, AttributeError):  # another torch: each block makes its own mesh, as FSDP2 does
        yield
        return
    made = {}

    def shared(reshard_after_forward, mesh_info):
        if isinstance(reshard_after_forward, bool):
            return original(reshard_after_forward, mesh_info)
        key = (reshard_after_forward, tuple(mesh_info.mesh.mesh.flatten().tolist()))
        if key not in made:
            made[key] = original(reshard_after_forward, mesh_info)
        return made[key]

    fully_shard_module._get_post_forward_mesh_info = shared
    try:
        yield
    finally:
        fully_shard_module._get_post_forward_mesh_info = original


def shard_of_rows(param) -> tuple[int, int]:
    """(index, count) of this rank's piece of a DTensor's rows: the mesh dimension it is Shard(0)
    along (the whole mesh for FSDP, the in-node dimension for hybrid)."""
    from torch.distributed.tensor import Shard

    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            return param.device_mesh.get_local_rank(dim), param.device_mesh.size(dim)
    return 0, 1


def reduce_dtype_of(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "bf16" else torch.float32
