"""FSDP2: each rank keeps 1/W of every parameter, gradient and optimizer state.

`fully_shard` goes on each decoder block, then on the root (embeddings, final norm, head), so
a block's full weights exist only while that block runs. It is applied to the skeleton on the
meta device, before any weight exists: materializing then allocates only this rank's shard,
and loading copies only this rank's rows from the safetensors files. That is what keeps the
peak memory of loading near model_bytes ÷ world_size instead of model_bytes in every rank.

A model built from scratch is the exception: its random init is computed whole (on CPU, from
the seed) and each rank keeps its rows, so that every strategy starts from the same weights.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from cputrain.errors import ConfigError
from cputrain.native.allocator import pin_mmap_threshold
from cputrain.model import copy_full_into, decoder_blocks, load_into, materialize, random_init, safetensors_files
from cputrain.parallel.base import Strategy, StrategyContext
from cputrain.parallel.file_reads import PlainReads
from cputrain.parallel.fsdp2_private import clear_sharding_prop_cache, one_post_forward_mesh, set_unshard_async
from cputrain.parallel.fsdp_layouts import layout_error, layout_of, overlaps_reduction


@dataclass(frozen=True)
class Layout:
    """parallel.layout's spec (cputrain.parallel.fsdp_layouts) on these ranks: what fully_shard is
    called with, and what each micro-batch toggles."""

    name: str
    world_size: int
    ranks_per_node: int

    def check(self) -> None:
        error = layout_error(self.name, self.world_size, self.ranks_per_node)
        if error:
            raise ConfigError(error)

    def mesh(self):
        """The device mesh the blocks are sharded on: None (FSDP2's default, every rank) or the spec's 2-D one."""
        shape = layout_of(self.name).mesh_shape(self.world_size, self.ranks_per_node)
        if shape is None:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))

    def block_reshard_after_forward(self) -> bool | int:
        return layout_of(self.name).reshard_after_forward(self.ranks_per_node)

    def wrap_context(self):
        """A layout keeping the node's share: the blocks share one post-forward mesh."""
        return one_post_forward_mesh() if layout_of(self.name).keeps_node_share else contextlib.nullcontext()

    def before_micro_batch(self, model: nn.Module, last: bool) -> None:
        """Set FSDP2's per-step toggles for the coming forward and backward: keep parameters
        gathered (and, where the layout says, gradients unreduced) until the step's last backward."""
        spec = layout_of(self.name)
        model.set_reshard_after_backward(last, recurse=spec.once_a_step)
        if spec.syncs_gradients_on_last_only:
            model.set_requires_gradient_sync(last)
        elif spec.all_reduces_on_last_only:
            model.set_requires_all_reduce(last)


def shard_of_rows(param) -> tuple[int, int]:
    """(index, count) of this rank's piece of a DTensor's rows: the mesh dimension it is Shard(0)
    along (the whole mesh for FSDP, the in-node dimension for hybrid)."""
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            return param.device_mesh.get_local_rank(dim), param.device_mesh.size(dim)
    return 0, 1


def reduce_dtype_of(name: str) -> torch.dtype:
    return torch.bfloat16 if name == "bf16" else torch.float32


def owned_rows(param: DTensor) -> slice:
    """Rows of dim 0 this rank holds under FSDP2's Shard(0): torch.chunk's split, last ones may be empty."""
    rows = param.shape[0]
    rank, world = shard_of_rows(param)
    per = -(-rows // world)
    start = min(rows, rank * per)
    return slice(start, min(rows, start + per))


def prefetch_neighbours(blocks: list[nn.Module], root: nn.Module) -> None:
    """Each block's forward starts the next block's gather, and each block's backward the previous
    one's, as asynchronous collectives: on CPU FSDP2 has no side stream, so a gather issued as the
    block it serves begins waits whole; issued one block ahead, gloo's thread moves it while this
    block computes. The issuing block waits for nothing; the block served waits at its start."""
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
    set_unshard_async(root)


class FSDPStrategy(Strategy):
    name = "fsdp"
    metered = True

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        pin_mmap_threshold()  # before the init replica and the first step free anything
        parallel = ctx.cfg.parallel
        # decided (cputrain.training.choices): "auto" cannot reach here, and check() refuses it if it does
        self.layout = Layout(parallel.layout, ctx.world_size, ctx.ranks_per_node)
        self.layout.check()
        self.reduce_dtype = reduce_dtype_of(parallel.reduce_dtype)
        # gloo's own reduce-scatter is an all-reduce and a slice: twice the bytes (parallel.reduce_scatter)
        self.all_to_all = parallel.reduce_scatter == "all_to_all" or (
            parallel.reduce_scatter == "auto" and parallel.backend == "gloo")
        # A layout that reduces once a step onto no gradient (gather_once) lets the all-to-all run
        # behind the rest of the backward (cputrain.parallel.reduce_scatter); set in wrap()
        self.overlaps_reduction = overlaps_reduction(parallel.layout, parallel.overlap_reduction,
                                                     "all_to_all" if self.all_to_all else "native")
        self.reduce_scatter = None

    def wrap(self, model: nn.Module) -> nn.Module:
        # bf16 compute gathers bf16 copies of the fp32 master weights; gradients are reduced in
        # parallel.reduce_dtype (fp32 unless bf16 is asked for: bf16 sums lose bits).
        param_dtype = torch.bfloat16 if self.ctx.compute_dtype == torch.bfloat16 else None
        kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=self.reduce_dtype)}
        # an overlapped reduction's output is the gradient's storage: fp32 master weights only
        overlapped = self.overlaps_reduction and all(
            p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
        mesh = self.layout.mesh()
        if mesh is not None:
            kwargs["mesh"] = mesh
        with self.layout.wrap_context():
            for block in decoder_blocks(model):
                fully_shard(block, reshard_after_forward=self.layout.block_reshard_after_forward(), **kwargs)
            fully_shard(model, **kwargs)
        if self.ctx.cfg.parallel.prefetch:
            prefetch_neighbours(decoder_blocks(model), model)
        if self.all_to_all:
            from cputrain.parallel.reduce_scatter import AllToAllReduceScatter, OverlappedReduceScatter

            if overlapped:
                self.reduce_scatter = OverlappedReduceScatter(self.ctx.world_size)
            for module in model.modules():
                if hasattr(module, "set_custom_reduce_scatter"):
                    module.set_custom_reduce_scatter(self.reduce_scatter or AllToAllReduceScatter())
        return model

    def accumulation(self, model: nn.Module, last_micro_batch: bool):
        self.layout.before_micro_batch(model, last_micro_batch)
        if self.reduce_scatter is None or not last_micro_batch:
            return contextlib.nullcontext()
        # FSDP2 views a new gradient into the reduce-scatter's output, but adds to one already held:
        # a sum filled in later is right only in the first case (set_to_none after every step)
        from cputrain.parallel.reduce_scatter import IN_FLIGHT

        self.reduce_scatter.in_flight = IN_FLIGHT if all(
            p.grad is None for p in model.parameters()) else 0
        return self._reduced_by_the_end()

    @contextlib.contextmanager
    def _reduced_by_the_end(self):
        """Every gradient summed once the step's last backward returns, before clipping reads it."""
        yield
        self.reduce_scatter.finish()

    def load_weights(self, model: nn.Module, folder: Path | None) -> None:
        materialize(model)  # allocates only this rank's shard of every parameter
        if folder is not None:
            # Plain reads of this rank's rows only (file_reads): no mapped copy of the shard.
            with PlainReads(safetensors_files(folder)) as files:
                load_into(model, folder, file_name_of=self.ctx.file_name_of,
                          copy_fn=lambda name, param, reader, key: files.copy_rows(
                              key, param.to_local(), owned_rows(param), reader))
            return
        full = self._full_random_init(model, self.ctx.cfg.seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                copy_full_into(param, full[name])  # every rank computed the same init: no scatter

    @staticmethod
    def _full_random_init(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            replica = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        materialize(replica)
        random_init(replica, seed)
        return dict(replica.named_parameters())

    def autocast(self):
        # The mixed-precision policy casts parameters to bf16 itself; autocast on top would only add casts.
        return contextlib.nullcontext()

    # full_state_dict: the protocol's own, which gathers one parameter at a time (full_tensor),
    # so at most one full tensor exists beside this rank's shards.

    def close(self) -> None:
        super().close()
        clear_sharding_prop_cache()


def build(ctx: StrategyContext) -> Strategy:
    return FSDPStrategy(ctx)

