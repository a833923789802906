"""What each FSDP layout (parallel.layout, its spec in cputrain.parallel.fsdp_layouts) holds per
rank beyond its shards, and over how many ranks it shards.

Every layout holds, while a micro-batch runs, the root (embeddings, final norm, head) gathered —
kept from the step's first forward to its last backward — the block that runs and the one
prefetched, gathered in the compute dtype, and one block's unsharded gradients as reduce-scattered,
in parallel.reduce_dtype (of its trained parameters: a frozen one gets none). Beyond that:

    full_shard    nothing
    node_reshard  every block's node share of its gathered parameters, kept from its forward to
                  its backward: L × P × (1/p − 1/W) (P one block's gathered bytes, p ranks per
                  node, W ranks): the backward gathers from it within the node
    gather_once   every block gathered for the whole step (not two at a time), and, where a step
                  has several micro-batches, the unsharded gradients of every trained parameter,
                  accumulated from the first micro-batch's backward until the last one
                  reduce-scatters them: in the reduce dtype (FSDP2 accumulates in reduce_dtype
                  where it differs from the parameters', else in theirs: the same bytes either
                  way). A step of one micro-batch reduces each block's gradients after its backward,
                  as full_shard does (measured on ~100M in fp32, 2 ranks: tests/e2e/test_plan_vs_measured.py)
    hybrid        nothing beyond full_shard's buffers, but the parameters, gradients and optimizer
                  state are sharded over a node's p ranks, not the W of the world
                  (cputrain.plan.memory.accounting's ÷ N with N = p)

The all-to-all reduce-scatter (parallel.reduce_scatter, cputrain.parallel.reduce_scatter) receives
a block's unsharded gradient from its peers: one more block's gradients in the reduce dtype, where
a reduce-scatter runs at all (FSDP2 skips it on a shard group of one rank).
"""

from __future__ import annotations

from cputrain.parallel.fsdp_layouts import FsdpLayout
from cputrain.plan.model_shape import ModelShape


def fsdp_buffer_bytes(m: ModelShape, spec: FsdpLayout, world_size: int, ranks_per_node: int | None,
                      gathered_bytes: int, reduce_bytes: int, all_to_all: bool, micro_batches: int = 1) -> int:
    """One rank's gathered parameters and unsharded gradients at the peak of a micro-batch;
    `micro_batches`: per rank per step (the accumulation)."""
    units = m.unit_params()
    blocks = [n for u, n in units.items() if u != "root"] or [0]
    root = units.get("root", 0)
    trained_blocks = [n for u, n in m.unit_params(trainable_only=True).items() if u != "root"] or [0]
    one_block_grads = max(trained_blocks) * reduce_bytes
    if spec.once_a_step:
        accumulated = m.trainable_params * reduce_bytes if micro_batches > 1 else 0
        held = (root + sum(blocks)) * gathered_bytes + accumulated + one_block_grads
    else:
        held = (root + 2 * max(blocks)) * gathered_bytes + one_block_grads
    if spec.keeps_node_share and ranks_per_node:
        held += int(sum(blocks) * gathered_bytes * (1 / ranks_per_node - 1 / world_size))
    if all_to_all and spec.shard_world(world_size, ranks_per_node) > 1:
        held += one_block_grads  # the all-to-all's receive buffer
    return held
