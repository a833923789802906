"""What each FSDP layout holds per rank, from the arithmetic of cputrain.plan.memory.fsdp_buffers:
node_reshard's node shares, gather_once's whole gathered model and unsharded gradients, hybrid's
state over a node's ranks, the reduce dtype and the all-to-all's receive buffer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cputrain.plan.memory.estimate import plan_inputs, plan_rank
from cputrain.plan.model_shape import ModelShape, ParamInfo

W, P = 4, 2


def shape() -> ModelShape:
    """4 blocks of a 16×8 matrix (128 elements each), a 32×8 embedding and head (512 of root)."""
    params = [ParamInfo("model.embed_tokens.weight", (32, 8), "root"), ParamInfo("lm_head.weight", (32, 8), "root")]
    params += [ParamInfo(f"model.layers.{i}.q.weight", (16, 8), f"layers.{i}") for i in range(4)]
    return ModelShape(tuple(params), layers=4, hidden=8, intermediate=16, heads=2, kv_heads=2, vocab=32,
                      tied_embeddings=False)


BLOCK, ROOT, L = 128, 512, 4
ALL = L * BLOCK + ROOT


def rank(layout: str = "full_shard", world: int = W, reduce_dtype: str = "fp32", reduce_scatter: str = "native",
         precision: str = "bf16", per_node: int | None = P, accumulation: int = 2):
    inputs = plan_inputs("fsdp", precision, world, micro_batch=1, seq_len=4, layout=layout, reduce_dtype=reduce_dtype,
                         reduce_scatter=reduce_scatter, ranks_per_node=per_node, accumulation=accumulation)
    return plan_rank(shape(), inputs)


def test_full_shard_holds_the_root_two_blocks_and_one_blocks_gradients():
    # bf16 gathers, fp32 reduction
    assert rank().comm_buffer_bytes == (ROOT + 2 * BLOCK) * 2 + BLOCK * 4
    assert rank(reduce_dtype="bf16").comm_buffer_bytes == (ROOT + 2 * BLOCK) * 2 + BLOCK * 2
    assert rank(precision="fp32").comm_buffer_bytes == (ROOT + 2 * BLOCK) * 4 + BLOCK * 4


def test_node_reshard_keeps_every_blocks_node_share_from_forward_to_backward():
    extra = rank("node_reshard").comm_buffer_bytes - rank().comm_buffer_bytes
    assert extra == int(L * BLOCK * 2 * (1 / P - 1 / W))  # L × P × (1/p − 1/W), P in the gathered dtype


def test_gather_once_holds_every_gathered_parameter_and_the_unsharded_gradients():
    for reduce_dtype, grad_bytes in (("fp32", 4), ("bf16", 2)):
        held = rank("gather_once", reduce_dtype=reduce_dtype).comm_buffer_bytes
        # the whole model gathered (bf16) for the step, every gradient accumulated unsharded in the
        # reduce dtype, and the reduce-scatter's input of one block
        assert held == ALL * 2 + ALL * grad_bytes + BLOCK * grad_bytes
    # one micro-batch a step: each block's gradients reduced after its backward, none accumulated
    assert rank("gather_once", accumulation=1).comm_buffer_bytes == ALL * 2 + BLOCK * 4
    # more than full_shard holds, and its state is the same
    assert rank("gather_once").param_bytes == rank().param_bytes


def test_hybrid_shards_the_state_over_a_nodes_ranks():
    full, hybrid = rank(), rank("hybrid")
    # every parameter's rows split 2 ways instead of 4 (the rows divide evenly here)
    assert hybrid.param_bytes == 2 * full.param_bytes == ALL * 4 // P
    assert hybrid.grad_bytes == 2 * full.grad_bytes and hybrid.optimizer_bytes > full.optimizer_bytes
    assert hybrid.comm_buffer_bytes == full.comm_buffer_bytes
    # rank 2, the first of node 1, holds what rank 0 holds
    inputs = plan_inputs("fsdp", "bf16", W, micro_batch=1, seq_len=4, layout="hybrid", ranks_per_node=P)
    assert plan_rank(shape(), inputs, 2).param_bytes == hybrid.param_bytes


def test_the_all_to_all_receives_one_blocks_gradients_where_a_reduce_scatter_runs():
    native, a2a = rank(), rank(reduce_scatter="all_to_all")
    assert a2a.comm_buffer_bytes - native.comm_buffer_bytes == BLOCK * 4
    assert rank(reduce_scatter="all_to_all", reduce_dtype="bf16").comm_buffer_bytes - rank(
        reduce_dtype="bf16").comm_buffer_bytes == BLOCK * 2
    # one rank (FSDP2 runs no reduce-scatter) and hybrid on nodes of one rank: no receive buffer
    assert rank(world=1, reduce_scatter="all_to_all", per_node=1).comm_buffer_bytes == rank(
        world=1, per_node=1).comm_buffer_bytes
    assert rank("hybrid", reduce_scatter="all_to_all", per_node=1).comm_buffer_bytes == rank(
        "hybrid", per_node=1).comm_buffer_bytes


def test_a_layout_per_node_needs_the_ranks_per_node():
    from cputrain.errors import ConfigError

    for layout in ("node_reshard", "hybrid"):
        with pytest.raises(ConfigError, match="--nproc-per-node"):
            rank(layout, per_node=None)
    assert rank("gather_once", per_node=None).comm_buffer_bytes > 0


def test_the_peak_counts_the_layouts_buffers_in_the_working_set():
    a, b = rank(), rank("gather_once")
    assert b.training_peak_bytes - a.training_peak_bytes == b.comm_buffer_bytes - a.comm_buffer_bytes
    assert replace(a, comm_buffer_bytes=0).training_peak_bytes < a.training_peak_bytes
