"""What each strategy sends per optimizer step: which collectives, of how many bytes, how often,
over which ranks, and how many TCP flows each puts through a node's link.

    single  nothing
    ddp     one all-reduce of the trained parameters' gradients per step (no_sync skips every
            micro-batch but the last), fp32 buckets of 25 MiB (DDP's bucket_cap_mb default;
            cputrain's comm hook keeps the bucket's dtype, the parameters' fp32)
    fsdp    FSDP2 as cputrain.parallel.fsdp builds it, in its parallel.layout: each layout's
            collectives a step (what, how often, over which ranks) are its spec's StepCollectives
            (cputrain.parallel.fsdp_layouts, whose docstring lists the layouts).
            In every layout the root (embeddings, final norm, head) is gathered once a step and
            kept; its gradients are reduced with the blocks' (every micro-batch, except under
            gather_once). bf16 gathers bf16 copies (param_dtype); gradients are reduced in
            parallel.reduce_dtype (fp32 or bf16); a LoRA base is gathered in the dtype it is
            stored in (bf16 under bf16), and only the adapters' gradients are reduced.
    zero3   DeepSpeed ZeRO-3, the same pattern as full_shard without a root kept gathered:
            parameters gathered for the forward and the backward (those under
            stage3_param_persistence_threshold stay whole, and a block whose backward follows its
            forward within stage3_max_reuse_distance elements stays gathered: every block of a
            model under ~500M parameters), gradients reduce-scattered every micro-batch, both in
            the parameters' dtype (bf16 under bf16: DeepSpeed keeps bf16 parameters and
            communicates in them by default).

Bytes per rank are what cputrain.distributed.comm meters: an all-reduce of N bytes 2(W−1)/W·N,
an all-gather of N bytes (N the whole tensor) (W−1)/W·N, a reduce-scatter as parallel.reduce_scatter
runs it on gloo: gloo's own ("native") is an all-reduce and a slice, 2(W−1)/W·N; the all-to-all
one sends each rank's slice once, (W−1)/W·N. The plan is gloo's (its efficiency table is):
reduce_scatter=auto plans the all-to-all, as a run on gloo takes it.

Through a node's link (ranks numbered node by node, p to a node, W in all, n nodes): a ring over
all ranks crosses each node's link once each way, carrying one rank's share, in one TCP flow; the
all-to-all sends every off-node peer its slice, p·(W−p)/W·N through the link in p·(W−p) flows; the
hybrid all-reduce runs one ring across the nodes per local rank, p flows carrying p rank shares;
collectives within a node cross no link. One node: no link at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.config.reduction import reduce_scatter_in_use
from cputrain.parallel.fsdp_layouts import ACROSS, DEFAULT_LAYOUT, NODE, SPECS, WORLD, StepCollective
from cputrain.plan.model_shape import ModelShape

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb=25, which cputrain keeps
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def ring_factor(kind: str, world: int) -> float:
    """Bytes one rank sends per byte of the whole tensor in a ring (cputrain.distributed.comm._RING)."""
    if world <= 1:
        return 0.0
    return 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world


@dataclass(frozen=True)
class Collective:
    """Every call of one collective in a step, alike: its kind, its ranks and its bytes."""

    kind: str  # all_gather | reduce_scatter | all_reduce
    what: str  # what it carries, as the plan prints it
    whole_bytes: int  # per step: the calls' whole tensors summed
    message_bytes: int  # one call's whole tensor
    span: str = WORLD  # WORLD | NODE | ACROSS
    via: str = "ring"  # ring; a reduce-scatter: native (gloo's all-reduce) or all_to_all

    def group(self, world: int, ranks_per_node: int) -> int:
        return {WORLD: world, NODE: ranks_per_node, ACROSS: world // max(ranks_per_node, 1)}[self.span]

    def rank_bytes(self, world: int, ranks_per_node: int) -> float:
        """What one rank sends per step (= what it receives), as the comm meter counts it."""
        g = self.group(world, ranks_per_node)
        as_kind = "all_reduce" if self.via == "native" else self.kind
        return self.whole_bytes * ring_factor(as_kind, g)

    def link_bytes(self, world: int, nnodes: int) -> float:
        """Bytes through one node's link per step, each way."""
        if nnodes <= 1 or self.span == NODE:
            return 0.0
        p = world // nnodes
        if self.span == ACROSS:
            return p * self.rank_bytes(world, p)  # one ring per local rank, each crossing the link once
        if self.via == "all_to_all":
            return self.whole_bytes * p * (world - p) / world  # each of p ranks to its W − p off-node peers
        return self.rank_bytes(world, p)  # a ring: one rank's share crosses each node's link

    def flows(self, world: int, nnodes: int) -> int:
        """TCP flows through one node's link each way."""
        if nnodes <= 1 or self.span == NODE:
            return 0
        p = world // nnodes
        if self.span == ACROSS:
            return p
        return p * (world - p) if self.via == "all_to_all" else 1


@dataclass(frozen=True)
class CommPattern:
    """One step's collectives on one rank, and the per-block figures the overlap model of
    ZeRO-3 needs (cputrain.plan.time.step_time)."""

    strategy: str
    layers: int
    collectives: tuple[Collective, ...] = ()
    layout: str = ""  # fsdp's parallel.layout
    reduce_dtype: str = ""  # fsdp and zero3: the dtype gradients are reduced in
    reduce_scatter: str = ""  # native | all_to_all
    ranks_per_node: int = 1
    block_gather_bytes: int = 0  # one block's parameters as gathered (FSDP/ZeRO-3)
    root_gather_bytes: int = 0  # embeddings, final norm and head as gathered
    block_reduce_bytes: int = 0  # one block's trained gradients as reduce-scattered
    root_reduce_bytes: int = 0
    backward_gathers: int = 0  # per micro-batch: blocks gathered again for the backward
    gathering_micro_batches: int = 0  # micro-batches per step that gather and reduce-scatter
    allreduce_bytes: int = 0  # DDP: gradients all-reduced once per step
    allreduce_message_bytes: int = 0

    def rank_bytes(self, world: int) -> dict[str, float]:
        """What one rank sends per step, each kind (= what it receives: the collectives are symmetric)."""
        out = {kind: 0.0 for kind in KINDS}
        for c in self.collectives:
            out[c.kind] += c.rank_bytes(world, self.ranks_per_node)
        return out

    def link_bytes(self, world: int, nnodes: int) -> dict[str, float]:
        """Bytes through one node's link per step, each way, each kind."""
        out = {kind: 0.0 for kind in KINDS}
        for c in self.collectives:
            out[c.kind] += c.link_bytes(world, nnodes)
        return out

    @property
    def whole_parameter_bytes(self) -> int:
        """Every block's and the root's parameters as gathered (FSDP/ZeRO-3)."""
        return self.layers * self.block_gather_bytes + self.root_gather_bytes


def _is_persistent(numel: int, threshold: int) -> bool:
    return threshold > 0 and numel <= threshold


def zero3_backward_gathers(layers: int, block_numel: int, head_numel: int, max_reuse_distance: int) -> int:
    """Blocks DeepSpeed gathers again for the backward: those whose parameters' next use (the
    backward) comes after more than stage3_max_reuse_distance elements are fetched in between;
    the others it keeps. Between block i's forward and backward come the later blocks' forwards
    and backwards and the head."""
    return sum(1 for i in range(layers) if 2 * (layers - 1 - i) * block_numel + head_numel > max_reuse_distance)


def reduce_dtype_bytes(strategy: str, precision: str, reduce_dtype: str | None) -> int:
    """Bytes per gradient element as reduced: fsdp's parallel.reduce_dtype (None: fp32, FSDP2's
    policy before the key), zero3's parameter dtype (bf16 under bf16)."""
    if strategy == "zero3":
        return 2 if precision == "bf16" else 4
    return 2 if reduce_dtype == "bf16" else 4


def comm_pattern(shape: ModelShape, strategy: str, precision: str, world_size: int, micro_batches: int, *,
                 nnodes: int = 1, persistence_threshold: int = 0, max_reuse_distance: int = 10**9,
                 layout: str = DEFAULT_LAYOUT, reduce_dtype: str | None = None,
                 reduce_scatter: str = "auto") -> CommPattern:
    """The step's collectives. `micro_batches`: per rank per step (the accumulation). `layout`,
    `reduce_dtype`: fsdp's decided parallel.layout and parallel.reduce_dtype (None: fp32);
    `reduce_scatter`: parallel.reduce_scatter (fsdp and zero3)."""
    layers = max(shape.layers, 1)
    if strategy == "single" or world_size <= 1:
        return CommPattern(strategy, layers)
    trained = [p for p in shape.params if p.trainable]
    if strategy == "ddp":
        grad_bytes = sum(p.numel * 4 for p in trained)  # fp32 masters and adapters: fp32 gradients
        message = min(DDP_BUCKET_BYTES, grad_bytes)
        return CommPattern(strategy, layers, (Collective("all_reduce", "gradients, once a step", grad_bytes, message),),
                           ranks_per_node=world_size // max(nnodes, 1), allreduce_bytes=grad_bytes,
                           allreduce_message_bytes=message)
    if strategy not in ("fsdp", "zero3"):
        raise ValueError(f"unknown strategy {strategy}")
    if strategy == "fsdp" and layout not in SPECS:
        raise ValueError(f"unknown layout {layout}")

    def gathered(p) -> int:
        if strategy == "zero3":
            return 2 if precision == "bf16" else p.stored_bytes
        # FSDP2's param_dtype casts to bf16 before gathering; under fp32 each is gathered as stored
        return min(p.stored_bytes, 2) if precision == "bf16" else p.stored_bytes

    grad_bytes = reduce_dtype_bytes(strategy, precision, reduce_dtype)
    via = reduce_scatter_in_use(reduce_scatter, "gloo")
    blocks = [p for p in shape.params if p.unit != "root"]
    root = [p for p in shape.params if p.unit == "root"]
    threshold = persistence_threshold if strategy == "zero3" else 0
    block_gather = sum(p.numel * gathered(p) for p in blocks if not _is_persistent(p.numel, threshold)) // layers
    root_gather = sum(p.numel * gathered(p) for p in root if not _is_persistent(p.numel, threshold))
    block_reduce = sum(p.numel * grad_bytes for p in blocks if p.trainable) // layers
    root_reduce = sum(p.numel * grad_bytes for p in root if p.trainable)
    per_node = world_size // max(nnodes, 1)
    figures = dict(ranks_per_node=per_node, block_gather_bytes=block_gather, root_gather_bytes=root_gather,
                   block_reduce_bytes=block_reduce, root_reduce_bytes=root_reduce, reduce_scatter=via,
                   reduce_dtype="bf16" if grad_bytes == 2 else "fp32")
    m = micro_batches
    if strategy == "zero3":
        block_numel = sum(p.numel for p in blocks) // layers
        head_numel = max((p.numel for p in root if "lm_head" in p.name), default=0)
        backward = zero3_backward_gathers(layers, block_numel, head_numel, max_reuse_distance)
        # DeepSpeed fetches module by module, coalesced up to stage3_prefetch_bucket_size elements,
        # and reduces in buckets of reduce_bucket_size elements (0.9·h² and h², deepspeed_config)
        h = shape.hidden
        gather_message = min(block_gather, int(0.9 * h * h) * (2 if precision == "bf16" else 4))
        reduce_message = min(block_reduce, h * h * grad_bytes)
        collectives = (
            Collective("all_gather", "parameters, forward and backward",
                       m * ((layers + backward) * block_gather + root_gather), gather_message),
            Collective("reduce_scatter", "gradients, every micro-batch", m * (layers * block_reduce + root_reduce),
                       reduce_message, via=via))
        return CommPattern(strategy, layers, collectives, backward_gathers=backward, gathering_micro_batches=m,
                           **figures)

    spec = SPECS[layout]
    all_grads = layers * block_reduce + root_reduce
    whole = {"blocks": layers * block_gather, "root": root_gather, "gradients": all_grads,
             "gradient_shards": all_grads // max(per_node, 1)}
    message = {"blocks": block_gather, "root": root_gather, "gradients": block_reduce,
               "gradient_shards": max(1, block_reduce // max(per_node, 1))}
    collectives = tuple(_collective(c, whole, message, m, via) for c in spec.collectives)
    return CommPattern(strategy, layers, collectives, layout=layout,
                       backward_gathers=layers if spec.gathers_for_backward else 0,
                       gathering_micro_batches=1 if spec.once_a_step else m, **figures)


def _collective(c: StepCollective, whole: dict[str, int], message: dict[str, int], micro_batches: int,
                via: str) -> Collective:
    """A layout's collective (cputrain.parallel.fsdp_layouts.StepCollective) in bytes."""
    times = (micro_batches if c.per_micro_batch else 1) * c.passes
    return Collective(c.kind, c.what, times * whole[c.carries], message[c.carries], span=c.span,
                      via=via if c.kind == "reduce_scatter" else "ring")
