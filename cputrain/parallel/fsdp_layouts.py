"""FSDP2's layouts, one spec each: where parameters are sharded and how often they cross the network.

On CPUs over Ethernet nothing hides a collective behind compute (FSDP2 has no side stream on CPU,
and gloo's threads take cores from the matmuls), so the bytes a step sends are what its layout
chooses. Each layout is FSDP2's own documented knobs, set at wrap time and per micro-batch:

    full_shard    every block sharded over all ranks, gathered for each micro-batch's forward
                  and again for its backward (FSDP2's default, the least memory)
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

Each spec (FsdpLayout) says what the layout refuses, the ranks it shards over, the buffers it
holds beyond its shards, its collectives per step and its reshard policy. The strategy
(cputrain.parallel.fsdp), the memory plan (cputrain.plan.memory.fsdp_buffers), the time plan
(cputrain.plan.time.comm_volume) and the config's rules (cputrain.training.preflight, choices)
read it; this is the one module that tells the layouts apart by name. No torch here: the plans
and the config's checks import it without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

# Which ranks a collective runs over: all of them (node-contiguous), one node's, or one per node.
WORLD, NODE, ACROSS = "world", "node", "across"


@dataclass(frozen=True)
class StepCollective:
    """One collective a layout runs in a step, in what it carries: `blocks` (every block's
    parameters as gathered, `passes` times), `root` (the root's, once a step), `gradients` (every
    trained gradient as reduced) or `gradient_shards` (a node's rank's shard of them)."""

    kind: str  # all_gather | reduce_scatter | all_reduce
    what: str  # as the plan prints it
    carries: str
    per_micro_batch: bool = False  # every micro-batch of the step, else once a step
    passes: int = 1  # blocks: gathered for the forward (1) or for the forward and the backward (2)
    span: str = WORLD


_ROOT_ONCE = StepCollective("all_gather", "the root (embeddings, norm, head), once a step", "root")


@dataclass(frozen=True)
class FsdpLayout:
    """One layout: its refusals, its shard world, its buffers, its collectives and its reshard policy."""

    name: str
    collectives: tuple[StepCollective, ...]
    # the ranks it shards over: a node's (a 2-D mesh, replicated across nodes) or the world's
    shards_within_node: bool = False
    # after a block's forward it keeps the node's share of its parameters (reshard_after_forward = ranks per node)
    keeps_node_share: bool = False
    # blocks gathered once a step and kept; gradients accumulate unsharded and are reduced once, after the last
    once_a_step: bool = False
    # what it refuses: fewer nodes or fewer ranks per node than these, in these words
    min_nodes: int = 1
    min_ranks_per_node: int = 1
    refusal: str = ""

    def refused(self, nodes: int, ranks_per_node: int) -> str | None:
        if nodes < self.min_nodes or ranks_per_node < self.min_ranks_per_node:
            return self.refusal.format(nodes=nodes, ranks_per_node=ranks_per_node)
        return None

    @property
    def needs_ranks_per_node(self) -> bool:
        """Its memory plan depends on how the ranks divide into nodes."""
        return self.shards_within_node or self.keeps_node_share

    def shard_world(self, world_size: int, ranks_per_node: int | None) -> int:
        """Ranks each parameter is split over: a node's, or the world's."""
        return (ranks_per_node or world_size) if self.shards_within_node else world_size

    def mesh_shape(self, world_size: int, ranks_per_node: int) -> tuple[int, int] | None:
        """The device mesh (replicate across nodes, shard along a node's ranks), or None for
        FSDP2's default, every rank. Ranks are node-contiguous (torchrun numbers a node's ranks together)."""
        return (world_size // ranks_per_node, ranks_per_node) if self.shards_within_node else None

    def reshard_after_forward(self, ranks_per_node: int) -> bool | int:
        """fully_shard's reshard_after_forward for the blocks."""
        if self.keeps_node_share:
            return ranks_per_node
        return not self.once_a_step

    @property
    def gathers_for_backward(self) -> bool:
        """Blocks gathered again for a micro-batch's backward (in the node or across it)."""
        return not self.once_a_step

    @property
    def syncs_gradients_on_last_only(self) -> bool:
        """Gradients reduced only after the step's last micro-batch (set_requires_gradient_sync)."""
        return self.once_a_step

    @property
    def reduces_behind_backward(self) -> bool:
        """Its reduce-scatter may be left running behind the rest of the backward and summed when it
        ends (cputrain.parallel.reduce_scatter.OverlappedReduceScatter): one reduction a step, onto no
        gradient held yet, and no all-reduce reading it at once."""
        return self.once_a_step and not self.shards_within_node

    @property
    def all_reduces_on_last_only(self) -> bool:
        """The shards all-reduced across nodes only after the step's last micro-batch (set_requires_all_reduce)."""
        return self.shards_within_node


FULL_SHARD = FsdpLayout("full_shard", (
    StepCollective("all_gather", "blocks, forward and backward, every micro-batch", "blocks", True, 2),
    _ROOT_ONCE,
    StepCollective("reduce_scatter", "gradients, every micro-batch", "gradients", True)))
NODE_RESHARD = FsdpLayout("node_reshard", (
    StepCollective("all_gather", "blocks for the forward, every micro-batch", "blocks", True),
    _ROOT_ONCE,
    StepCollective("all_gather", "blocks for the backward, from the node's share", "blocks", True, span=NODE),
    StepCollective("reduce_scatter", "gradients, every micro-batch", "gradients", True)),
    keeps_node_share=True, min_nodes=2, min_ranks_per_node=2,
    refusal=("parallel.layout=node_reshard keeps a node's share after the forward: it needs 2 or more nodes of 2 "
             "or more ranks (here {nodes} node(s) of {ranks_per_node}); use full_shard or gather_once"))
GATHER_ONCE = FsdpLayout("gather_once", (
    StepCollective("all_gather", "blocks, once a step", "blocks"),
    _ROOT_ONCE,
    StepCollective("reduce_scatter", "gradients, once a step", "gradients")), once_a_step=True)
HYBRID = FsdpLayout("hybrid", (
    StepCollective("all_gather", "blocks, forward and backward, every micro-batch, in the node", "blocks", True, 2,
                   span=NODE),
    StepCollective("all_gather", "the root, once a step, in the node", "root", span=NODE),
    StepCollective("reduce_scatter", "gradients, every micro-batch, in the node", "gradients", True, span=NODE),
    # each rank all-reduces its shard of the gradients with its peers on the other nodes, once a step
    StepCollective("all_reduce", "gradient shards across the nodes, once a step", "gradient_shards", span=ACROSS)),
    shards_within_node=True, min_nodes=2,
    refusal=("parallel.layout=hybrid replicates across nodes: on one node it is full_shard; use full_shard "
             "(or run on 2 or more nodes)"))

SPECS = {spec.name: spec for spec in (FULL_SHARD, NODE_RESHARD, GATHER_ONCE, HYBRID)}
LAYOUTS = tuple(SPECS)  # in the order a tie between them is broken: full_shard first
DEFAULT_LAYOUT = FULL_SHARD.name  # FSDP2's default and the least memory: what a plan takes where it cannot choose
PLANNED_PER_NODE = frozenset(name for name, spec in SPECS.items() if spec.needs_ranks_per_node)


def layout_of(name: str) -> FsdpLayout:
    if name not in SPECS:
        raise ValueError(f"unknown layout {name}")
    return SPECS[name]


def overlaps_reduction(layout: str, setting: bool, reduce_scatter: str) -> bool:
    """Whether an fsdp run leaves its reduce-scatter running behind the backward: parallel.overlap_reduction
    (`setting`) on a layout that allows it, with the all-to-all reduce-scatter (`reduce_scatter` as it
    runs: cputrain.config.reduction.reduce_scatter_in_use), the one cputrain issues itself."""
    return setting and layout_of(layout).reduces_behind_backward and reduce_scatter == "all_to_all"


def layout_error(layout: str, world_size: int, ranks_per_node: int) -> str | None:
    """Why `layout` cannot run on `world_size` ranks, `ranks_per_node` to a node (None: it can)."""
    if layout not in SPECS:
        return f"parallel.layout={layout} is not a layout; choose one of {', '.join(LAYOUTS)} (or auto)"
    if ranks_per_node < 1 or world_size % ranks_per_node:
        return (f"{world_size} ranks do not divide into nodes of {ranks_per_node}: every node must run the same "
                "number of ranks (--nproc-per-node)")
    return SPECS[layout].refused(world_size // ranks_per_node, ranks_per_node)
