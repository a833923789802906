"""What each strategy sends per optimizer step: which collectives, of how many bytes, how often.

    single  nothing
    ddp     one all-reduce of the trained parameters' gradients per step (no_sync skips every
            micro-batch but the last), fp32 buckets of 25 MiB (DDP's bucket_cap_mb default;
            cputrain's comm hook keeps the bucket's dtype, the parameters' fp32)
    fsdp    FSDP2 as cputrain.parallel.fsdp builds it, every micro-batch: each block's
            parameters all-gathered in the forward and again in the backward (blocks reshard
            after forward, FSDP2's default), the root (embeddings, final norm, head) once (FSDP2
            keeps the root gathered after its forward); the trained gradients reduce-scattered
            (no gradient sync is skipped under accumulation). bf16 gathers bf16 copies
            (param_dtype) and reduces fp32 (reduce_dtype); a LoRA base is gathered in the dtype
            it is stored in (bf16 under bf16), and only the adapters' gradients are reduced.
    zero3   DeepSpeed ZeRO-3, the same pattern: parameters gathered for the forward and the
            backward (those under stage3_param_persistence_threshold stay whole, and a block
            whose backward follows its forward within stage3_max_reuse_distance elements
            stays gathered: every block of a model under ~500M parameters), gradients
            reduce-scattered every micro-batch, both in the parameters' dtype (bf16 under bf16:
            DeepSpeed keeps bf16 parameters and communicates in them by default).

Bytes on the wire per rank are the ring costs cputrain.distributed.comm counts: an all-reduce of
N bytes 2(W−1)/W·N, an all-gather or reduce-scatter of N bytes (N the whole tensor) (W−1)/W·N.
The variants a plan's advice asks about are fields here too: no resharding after the forward,
parameters kept gathered across micro-batches, and a hybrid layout (shard within a node,
replicate across nodes), which cputrain does not build yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.plan.model_shape import ModelShape

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb=25, which cputrain keeps
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def ring_factor(kind: str, world: int) -> float:
    """Bytes one rank sends per byte of the whole tensor (cputrain.distributed.comm._RING)."""
    if world <= 1:
        return 0.0
    return 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world


@dataclass(frozen=True)
class CommPattern:
    """Whole-tensor bytes of one step's collectives on one rank, in the shape the overlap model
    needs: per decoder block and for the root, and how often each repeats."""

    strategy: str
    layers: int
    block_gather_bytes: int = 0  # one block's parameters as gathered (FSDP/ZeRO-3)
    root_gather_bytes: int = 0  # embeddings, final norm and head as gathered
    block_reduce_bytes: int = 0  # one block's trained gradients as reduce-scattered
    root_reduce_bytes: int = 0
    backward_gathers: int = 0  # per micro-batch: blocks gathered again for the backward (all, or none unresharded)
    gathering_micro_batches: int = 0  # micro-batches per step that gather and reduce-scatter
    allreduce_bytes: int = 0  # DDP (or a hybrid layout's replicas): gradients all-reduced once per step
    allreduce_message_bytes: int = 0
    allreduce_world: int = 0  # ranks in that all-reduce (the world, or the nodes of a hybrid layout)
    hybrid_ranks_per_node: int = 0  # > 0: gathers and reduce-scatters stay inside a node of this many ranks
    gather_message_bytes: int = 0  # one all-gather call (FSDP2: a block; ZeRO-3: up to its prefetch bucket)
    reduce_message_bytes: int = 0  # one reduce-scatter call (FSDP2: a block; ZeRO-3: up to its reduce bucket)

    def whole_bytes(self) -> dict[str, int]:
        """Whole-tensor bytes per step of each collective kind (before the ring factor)."""
        reps = self.gathering_micro_batches
        return {
            "all_gather": reps * ((self.layers + self.backward_gathers) * self.block_gather_bytes
                                  + self.root_gather_bytes),
            "reduce_scatter": reps * (self.layers * self.block_reduce_bytes + self.root_reduce_bytes),
            "all_reduce": self.allreduce_bytes,
        }

    def rank_bytes(self, world: int) -> dict[str, float]:
        """What one rank sends per step, each kind (= what it receives: ring collectives are symmetric)."""
        whole = self.whole_bytes()
        shard_world = self.hybrid_ranks_per_node or world
        return {kind: whole[kind] * ring_factor(kind, self.allreduce_world if kind == "all_reduce" else shard_world)
                for kind in KINDS}

    def link_bytes(self, world: int, nnodes: int) -> dict[str, float]:
        """Bytes through one node's link per step, each way. Ranks are node-contiguous, so a ring over
        all ranks crosses each node's link once, carrying one rank's share; a hybrid layout keeps its
        gathers inside the node, and its all-reduce of each rank's gradient shard runs across nodes
        for every rank of the node at once. One node: no link at all."""
        if nnodes <= 1:
            return {kind: 0.0 for kind in KINDS}
        per_rank = self.rank_bytes(world)
        if self.hybrid_ranks_per_node:
            return {"all_gather": 0.0, "reduce_scatter": 0.0,
                    "all_reduce": per_rank["all_reduce"] * self.hybrid_ranks_per_node}
        return per_rank


def _is_persistent(numel: int, threshold: int) -> bool:
    return threshold > 0 and numel <= threshold


def zero3_backward_gathers(layers: int, block_numel: int, head_numel: int, max_reuse_distance: int) -> int:
    """Blocks DeepSpeed gathers again for the backward: those whose parameters' next use (the
    backward) comes after more than stage3_max_reuse_distance elements are fetched in between;
    the others it keeps. Between block i's forward and backward come the later blocks' forwards
    and backwards and the head."""
    return sum(1 for i in range(layers) if 2 * (layers - 1 - i) * block_numel + head_numel > max_reuse_distance)


def comm_pattern(shape: ModelShape, strategy: str, precision: str, world_size: int, micro_batches: int, *,
                 nnodes: int = 1, persistence_threshold: int = 0, max_reuse_distance: int = 10**9,
                 reshard_after_forward: bool = True,
                 gather_once_per_step: bool = False, hybrid: bool = False) -> CommPattern:
    """The step's collectives. `micro_batches`: per rank per step (the accumulation).
    `reshard_after_forward=False`, `gather_once_per_step` and `hybrid` plan layouts cputrain does
    not build yet (FSDP/ZeRO-3 only); the advice quotes their figures."""
    layers = max(shape.layers, 1)
    if strategy == "single" or world_size <= 1:
        return CommPattern(strategy, layers)
    trained = [p for p in shape.params if p.trainable]
    if strategy == "ddp":
        grad_bytes = sum(p.numel * 4 for p in trained)  # fp32 masters and adapters: fp32 gradients
        return CommPattern(strategy, layers, allreduce_bytes=grad_bytes,
                           allreduce_message_bytes=min(DDP_BUCKET_BYTES, grad_bytes), allreduce_world=world_size)
    if strategy not in ("fsdp", "zero3"):
        raise ValueError(f"unknown strategy {strategy}")

    def gathered(p) -> int:
        if strategy == "zero3":
            return 2 if precision == "bf16" else p.stored_bytes
        # FSDP2's param_dtype casts to bf16 before gathering; under fp32 each is gathered as stored
        return min(p.stored_bytes, 2) if precision == "bf16" else p.stored_bytes

    reduce_dtype_bytes = 2 if (strategy == "zero3" and precision == "bf16") else 4
    blocks = [p for p in shape.params if p.unit != "root"]
    root = [p for p in shape.params if p.unit == "root"]
    threshold = persistence_threshold if strategy == "zero3" else 0
    block_gather = sum(p.numel * gathered(p) for p in blocks if not _is_persistent(p.numel, threshold)) // layers
    root_gather = sum(p.numel * gathered(p) for p in root if not _is_persistent(p.numel, threshold))
    block_reduce = sum(p.numel * reduce_dtype_bytes for p in blocks if p.trainable) // layers
    root_reduce = sum(p.numel * reduce_dtype_bytes for p in root if p.trainable)
    gather_message, reduce_message = block_gather, block_reduce
    # kept gathered across the step's micro-batches: no block is gathered again for a backward either
    backward_gathers = layers if reshard_after_forward and not gather_once_per_step else 0
    if strategy == "zero3":
        block_numel = sum(p.numel for p in blocks) // layers
        head_numel = max((p.numel for p in root if "lm_head" in p.name), default=0)
        if backward_gathers:
            backward_gathers = zero3_backward_gathers(layers, block_numel, head_numel, max_reuse_distance)
        # DeepSpeed fetches module by module, coalesced up to stage3_prefetch_bucket_size elements,
        # and reduces in buckets of reduce_bucket_size elements (0.9·h² and h², deepspeed_config)
        h = shape.hidden
        gather_message = min(block_gather, int(0.9 * h * h) * (2 if precision == "bf16" else 4))
        reduce_message = min(block_reduce, h * h * reduce_dtype_bytes)
    pattern = CommPattern(
        strategy, layers, block_gather_bytes=block_gather, root_gather_bytes=root_gather,
        block_reduce_bytes=block_reduce, root_reduce_bytes=root_reduce,
        backward_gathers=backward_gathers,
        gathering_micro_batches=1 if gather_once_per_step else micro_batches,
        gather_message_bytes=gather_message, reduce_message_bytes=reduce_message)
    if hybrid and nnodes > 1 and world_size % nnodes == 0:
        per_node = world_size // nnodes
        # each rank all-reduces its shard of the gradients with its peers on the other nodes, once a step
        shard_grads = (layers * block_reduce + root_reduce) // per_node
        pattern = CommPattern(
            strategy, layers, block_gather_bytes=block_gather, root_gather_bytes=root_gather,
            block_reduce_bytes=block_reduce, root_reduce_bytes=root_reduce,
            backward_gathers=pattern.backward_gathers, gathering_micro_batches=pattern.gathering_micro_batches,
            allreduce_bytes=shard_grads, allreduce_message_bytes=max(1, block_reduce // per_node),
            allreduce_world=nnodes, hybrid_ranks_per_node=per_node, gather_message_bytes=gather_message,
            reduce_message_bytes=reduce_message)
    return pattern
