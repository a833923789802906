"""The one door to FSDP2's (and DTensor's) private names: everything cputrain reaches that torch
does not promise to keep. A torch upgrade that moves one breaks here, and
tests/unit/test_fsdp2_private.py names what moved (PRIVATE_NAMES).

    ReduceScatter                 the base class of a custom reduce-scatter, for FSDP2's own hook
                                  FSDPModule.set_custom_reduce_scatter (cputrain.parallel.reduce_scatter)
    set_unshard_async             FSDPModule._set_unshard_async_op: prefetched gathers issued
                                  asynchronously, the way on a device without side streams
    one_post_forward_mesh         patches _fully_shard._get_post_forward_mesh_info so node_reshard's
                                  blocks share one node-sized mesh
    clear_sharding_prop_cache     DTensor's sharding-propagation caches, which hold the process group
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # noqa: F401 (the base class, re-exported)

# (module, attribute) of each private name used, for the test that fails loudly when one moves
PRIVATE_NAMES = (
    ("torch.distributed.fsdp._fully_shard._fsdp_api", "ReduceScatter"),
    ("torch.distributed.fsdp._fully_shard._fully_shard", "_get_post_forward_mesh_info"),
    ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule._set_unshard_async_op"),
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
)


def set_unshard_async(root: nn.Module) -> None:
    """FSDP2 issues a prefetch synchronously unless its modules' unshards are asynchronous (the
    documented way on a device without side streams: FSDPModule._set_unshard_async_op)."""
    root._set_unshard_async_op(True)


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


def clear_sharding_prop_cache() -> None:
    """DTensor's sharding-propagation caches keep the specs of every op seen, and through their
    device mesh the process group: cleared, the group can be destroyed before teardown."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a torch without it keeps the group until exit, as before
        return
    _clear_sharding_prop_cache()
