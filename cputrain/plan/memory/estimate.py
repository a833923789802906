"""One rank's memory plan: stored state, working set, buffers and the fixed process cost."""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass

from cputrain.errors import ConfigError
from cputrain.lora.adapters import is_adapter_parameter
from cputrain.plan.memory.accounting import BF16_BYTES, FP32_BYTES, SHARDED, local_numel, state_bytes
from cputrain.parallel.fsdp_layouts import DEFAULT_LAYOUT, PLANNED_PER_NODE, SPECS
from cputrain.plan.memory.fsdp_buffers import fsdp_buffer_bytes
from cputrain.plan.memory.activations import activation_bytes, attention_mask_bytes
from cputrain.plan.model_shape import ModelShape

GIB = 2**30

# RSS of a rank before it builds the model: Python, torch, transformers, the tokenizer, the
# packed data and the gloo process group. Measured as the "process group" phase of memory.json
# on x86-64 Linux with torch 2.13 (0.33-0.35 GiB with the model code imported); it hardly
# depends on the model.
PROCESS_OVERHEAD_BYTES = int(0.35 * GIB)
# What scipy adds to that where it is installed (the eval extra brings it, with
# lm-evaluation-harness, and so do many environments): transformers imports scipy.optimize with
# its modeling code whenever scipy can be imported. Measured 35 MiB of RSS after torch and
# transformers' Llama (336 → 371 MiB, scipy 1.17, torch 2.13); the plan is of this installation.
SCIPY_IMPORT_BYTES = 35 * 2**20 if importlib.util.find_spec("scipy") is not None else 0
# What zero3 adds to that, independent of the model: importing deepspeed (0.02 GiB, measured as
# the RSS of the import after torch and transformers) and deepspeed.initialize's engine, its
# process subgroups and buffers (0.04-0.05 GiB, the "optimizer created" phase of a 0.1M-parameter
# model beyond its state bytes), with torch 2.13 and DeepSpeed 0.19.
DEEPSPEED_RUNTIME_BYTES = int(0.07 * GIB)
# What model.lora adds to that: importing peft and injecting its LoRA layers, 12 MiB of RSS
# measured around add_adapters on a 0.1M-parameter Llama's skeleton after torch and
# transformers were imported (peft 0.21); the adapters' own bytes are counted apart.
LORA_RUNTIME_BYTES = 12 * 2**20

# DDP copies gradients into flat buckets for its all-reduce; with gradient_as_bucket_view the
# .grad tensors are views of those buckets instead, and the copy disappears.
DDP_GRAD_AS_BUCKET_VIEW = True  # as cputrain.parallel.ddp builds it


@dataclass(frozen=True)
class PlanInputs:
    strategy: str  # single | ddp | fsdp | zero3 (decided: cputrain.training.choices)
    precision: str  # fp32 | bf16
    world_size: int
    micro_batch: int
    seq_len: int
    activation_checkpointing: bool | int | str = False  # resolved: every block, none, the first N, or "selective"
    offload_optimizer: bool = False
    offload_param: bool = False
    from_scratch: bool = True  # random init from model.arch; False: weights from a model folder
    persistence_threshold: int = 0  # zero3: DeepSpeed's stage3_param_persistence_threshold
    max_reuse_distance: int = 10**9  # zero3: DeepSpeed's stage3_max_reuse_distance (its default)
    lora_dropout: float = 0.0  # model.lora.dropout: each adapter then saves its own dropped-out input
    chunked_loss: bool = False  # model.chunked_loss as resolved (resolve.chunked_loss_choice)
    eager_attention: bool = False  # model.attn_implementation=eager: each block keeps its attention matrix
    layout: str = DEFAULT_LAYOUT  # fsdp: parallel.layout, decided (cputrain.parallel.fsdp_layouts)
    reduce_dtype: str | None = None  # fsdp: parallel.reduce_dtype, decided (None: fp32)
    reduce_scatter: str = "all_to_all"  # fsdp and zero3: as it runs (native | all_to_all: config.reduction)
    prefetch: bool = False  # fsdp: parallel.prefetch (the time plan hides part of the gathers behind compute)
    overlap_reduction: bool = False  # fsdp: parallel.overlap_reduction (where the layout allows it: fsdp_layouts.overlaps_reduction)
    ranks_per_node: int | None = None  # node_reshard and hybrid read it (None: not known)
    accumulation: int = 1  # micro-batches per rank per step: gather_once accumulates unsharded gradients over them
    extra_forwards: int = 0  # no-grad forwards a step runs beyond its own (the objective's extra_forwards)
    rollout_rows: int = 0  # online RL: completions this rank samples a step (0: no rollout)
    rollout_len: int = 0  # online RL: the positions a rollout's row holds (prompt + completion ≤ data.seq_len)
    attention_mask: bool = False  # the rows carry a 4D mask: rows of several sequences (build.carries_attention_mask)


@dataclass(frozen=True)
class RankPlan:
    """Bytes one rank needs; `total_bytes` is the expected peak RSS."""

    rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    # temporaries of the optimizer step, and ddp's bucket rebuild right after it (freed before the
    # next forward's activations)
    optimizer_step_bytes: int
    comm_buffer_bytes: int
    process_overhead_bytes: int
    load_bytes: int = 0  # held only while the weights are built or loaded, beside the parameters
    offload_buffer_bytes: int = 0  # zero3 offload: host gradient buffers the offloaded optimizer steps on
    rollout_bytes: int = 0  # online RL: the rollout's KV cache and its last position's logits, before the step's forwards

    @property
    def training_peak_bytes(self) -> int:
        # The forward/backward working set (activations, gathered parameters, unreduced
        # gradients) and the optimizer step's temporaries are never alive together: the step
        # runs after the backward has freed activations and released what it gathered.
        # Online RL's rollout runs before the step's forwards, its KV cache freed when it ends.
        working = max(self.activation_bytes + self.comm_buffer_bytes, self.optimizer_step_bytes, self.rollout_bytes)
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.offload_buffer_bytes + working
                + self.process_overhead_bytes)

    @property
    def load_peak_bytes(self) -> int:
        # Before the first step: no gradients, no optimizer state yet.
        return self.param_bytes + self.load_bytes + self.process_overhead_bytes

    @property
    def total_bytes(self) -> int:
        return max(self.training_peak_bytes, self.load_peak_bytes)

    def as_dict(self) -> dict:
        return {**asdict(self), "training_peak_bytes": self.training_peak_bytes,
                "load_peak_bytes": self.load_peak_bytes, "total_bytes": self.total_bytes}


def plan_inputs(strategy: str, precision: str, world_size: int, **kw) -> PlanInputs:
    """The inputs of one plan, from decided values (cputrain.training.choices)."""
    if world_size < 1:
        raise ConfigError(f"world size must be at least 1 (got {world_size}); set --world-size or --nnodes × --nproc-per-node")
    if strategy == "single" and world_size > 1:
        raise ConfigError(f"parallel.strategy=single runs one rank, but the world size is {world_size}; "
                          "choose ddp, fsdp or zero3")
    if strategy == "fsdp" and kw.get("layout") in PLANNED_PER_NODE and not kw.get("ranks_per_node"):
        raise ConfigError(f"parallel.layout={kw['layout']} is planned per node: give the ranks per node "
                          "(--nproc-per-node)")
    return PlanInputs(strategy=strategy, precision=precision, world_size=world_size, **kw)


def zero3_gathered_numel(m: ModelShape, max_reuse_distance: int) -> int:
    """Parameters ZeRO-3 holds gathered at the end of a forward pass, from the second step on.

    Once DeepSpeed has traced one step it keeps a module's gathered parameters instead of
    releasing them when they are used again within `stage3_max_reuse_distance` elements of
    parameters (PartitionedParameterCoordinator.__params_to_release). A forward unit's next use
    is its backward, after every later unit has run forward and backward: 2 × the parameters
    after it. The default distance (1e9) keeps the whole model gathered for models up to 500M.
    """
    units = m.unit_params()
    embed = sum(p.numel for p in m.params if p.unit == "root" and "embed" in p.name)
    order = [embed] + [n for u, n in units.items() if u != "root"] + [units.get("root", 0) - embed]
    kept = 0
    for i, numel in enumerate(order):
        if 2 * sum(order[i + 1:]) < max_reuse_distance:
            kept += numel
    blocks = [n for u, n in units.items() if u != "root"] or [0]
    return max(kept, units.get("root", 0) + 2 * max(blocks))  # at least the unit running and the next


def _comm_buffer_bytes(m: ModelShape, inp: PlanInputs, local_params: int) -> int:
    blocks = [n for u, n in m.unit_params().items() if u != "root"] or [0]
    gathered_bytes = 2 if inp.precision == "bf16" else 4
    if inp.strategy == "ddp":
        return 0 if DDP_GRAD_AS_BUCKET_VIEW else m.trainable_params * FP32_BYTES
    if inp.strategy == "fsdp":
        # Unsharded (all-gathered) parameters in the compute dtype and unsharded gradients in the
        # reduce dtype, as the layout holds them (cputrain.plan.memory.fsdp_buffers).
        return fsdp_buffer_bytes(m, SPECS[inp.layout], inp.world_size, inp.ranks_per_node, gathered_bytes,
                                 BF16_BYTES if inp.reduce_dtype == "bf16" else FP32_BYTES,
                                 inp.reduce_scatter == "all_to_all", inp.accumulation)
    if inp.strategy == "zero3":
        # Gathered parameters (see zero3_gathered_numel) and one block's full gradients before
        # they are reduced into the partitions.
        return zero3_gathered_numel(m, inp.max_reuse_distance) * gathered_bytes + max(blocks) * gathered_bytes
    return 0


def _load_bytes(m: ModelShape, inp: PlanInputs, rank: int = 0) -> int:
    """What building the weights holds beyond this rank's parameters, as each strategy does it.

    - fsdp from scratch: the random init is computed for the whole model in fp32 on every rank
      (so that every strategy starts from the same weights from the same seed) and each rank
      copies its rows out (cputrain.parallel.fsdp); the whole copy is alive at the end.
    - zero3 from scratch: transformers' ZeRO-3 init gathers one module's parameters at a time,
      so the largest module (the embedding or the head) is whole once, in the compute dtype.
    - single and ddp initialise their own full copy in place (ddp without a start-up broadcast:
      every rank draws the same init, cputrain.parallel.replica_check).
    - From a model folder, every strategy but zero3 reads with plain file reads into the
      parameters (not through safetensors' memory map, whose pages would stay in the RSS): only
      a tensor stored in another dtype takes a buffer of its own (_read_buffer_bytes).
    - LoRA: the adapters' initial values, whole and fp32 on every rank, are computed with the
      skeleton and kept until they are copied into the materialized (sharded) adapters.
    """
    adapter_init = sum(p.numel for p in m.params if is_adapter_parameter(p.name)) * FP32_BYTES
    return adapter_init + _strategy_load_bytes(m, inp, rank)


def _read_buffer_bytes(m: ModelShape, inp: PlanInputs, rank: int) -> int:
    """The largest buffer a rank reads a tensor into while loading from a model folder (0 without
    one; zero3 loads through DeepSpeed and is not planned here). Plain reads go straight into the
    parameter (cputrain.parallel.file_reads), except for a tensor the file stores in another dtype
    (a bf16 file into fp32 masters): that one is read whole (fsdp: its rows) into a buffer of the
    file's dtype and cast, one tensor at a time."""
    if inp.strategy in ("single", "ddp"):
        read = [p.numel * p.file_bytes for p in m.params if p.file_bytes and p.file_bytes != p.stored_bytes]
    elif inp.strategy == "fsdp":
        shards, index = _fsdp_shard(inp, rank)
        read = [local_numel(p.shape, "fsdp", shards, index, padded=False) * p.file_bytes
                for p in m.params if p.file_bytes and p.file_bytes != p.stored_bytes]
    else:
        return 0
    return max(read, default=0)


def _strategy_load_bytes(m: ModelShape, inp: PlanInputs, rank: int) -> int:
    if not inp.from_scratch:
        return _read_buffer_bytes(m, inp, rank)
    if inp.strategy == "fsdp":
        return m.total_params * FP32_BYTES
    if inp.strategy == "zero3":
        largest = max((p.numel for p in m.params), default=0)
        return largest * (2 if inp.precision == "bf16" else FP32_BYTES)
    return 0


def _fsdp_shard(inp: PlanInputs, rank: int) -> tuple[int, int]:
    """(ranks a parameter is split over, this rank's index among them): hybrid's are its node's
    (ranks are numbered node by node)."""
    shards = (SPECS[inp.layout].shard_world(inp.world_size, inp.ranks_per_node) if inp.strategy == "fsdp"
              else inp.world_size)
    return shards, rank % shards


def plan_rank(m: ModelShape, inp: PlanInputs, rank: int = 0) -> RankPlan:
    shards, index = _fsdp_shard(inp, rank)
    state = state_bytes(m, inp.strategy, inp.precision, shards, index, inp.persistence_threshold,
                        inp.offload_optimizer and inp.strategy == "zero3")
    # Autocast keeps bf16 copies of the fp32 weights it casts (a frozen base already stored in
    # bf16 is used as it is); sharded strategies gather (and cast) one unit at a time, which the
    # communication buffers already count.
    weights_cast = 0 if SHARDED[inp.strategy] else sum(p.numel for p in m.params if p.stored_bytes == FP32_BYTES)
    act = activation_bytes(m, inp.micro_batch, inp.seq_len, inp.precision, inp.activation_checkpointing,
                           weights_cast, inp.lora_dropout, inp.chunked_loss, inp.eager_attention)
    # Fused AdamW updates each parameter in one kernel, with no temporary of a group's size.
    step_tmp = 0
    if inp.strategy == "zero3":
        if inp.offload_optimizer:
            # DeepSpeedCPUAdam steps the host fp32 partitions in place, on the host gradient buffers.
            step_tmp = 0
        else:
            # Before stepping, DeepSpeed flattens the sub-group's gradient partitions into a new
            # fp32 tensor as the masters' .grad (stage3 _prepare_fp32_grad_for_sub_group).
            # sub_group_size (1e9) puts a whole parameter group in one.
            step_tmp = state.local_params * FP32_BYTES
    elif inp.strategy == "ddp" and inp.accumulation > 1 and DDP_GRAD_AS_BUCKET_VIEW:
        # Where a step accumulates, the gradients stay views of DDP's buckets across steps
        # (cputrain.parallel.ddp), and DDP's one rebuild of its buckets, right after the first step,
        # allocates the new ones while the views hold the old: a second copy of the gradients for a
        # moment when no activation is alive (measured +0.27 GiB a rank at ~88M with short rows).
        step_tmp = state.grad_bytes
    return RankPlan(
        rank=rank,
        param_bytes=state.param_bytes,
        grad_bytes=state.grad_bytes,
        optimizer_bytes=state.optimizer_bytes,
        activation_bytes=act.saved_bytes + act.weight_copy_bytes
        + (attention_mask_bytes(inp.micro_batch, inp.seq_len, inp.precision, inp.strategy) if inp.attention_mask else 0),
        optimizer_step_bytes=step_tmp,
        comm_buffer_bytes=_comm_buffer_bytes(m, inp, state.local_params),
        process_overhead_bytes=PROCESS_OVERHEAD_BYTES + SCIPY_IMPORT_BYTES
        + (DEEPSPEED_RUNTIME_BYTES if inp.strategy == "zero3" else 0)
        + (LORA_RUNTIME_BYTES if m.lora else 0),
        load_bytes=_load_bytes(m, inp, rank),
        # With optimizer offload DeepSpeed gives each sub-group's fp32 master a gradient buffer of
        # its own (stage3 _initialize_optimizer_states), beside the gradient partitions the
        # backward reduces into: a second fp32 copy of this rank's gradients, kept all run.
        offload_buffer_bytes=state.local_params * FP32_BYTES if inp.strategy == "zero3" and inp.offload_optimizer else 0,
        rollout_bytes=rollout_bytes(m, inp),
    )


def rollout_bytes(m: ModelShape, inp: PlanInputs) -> int:
    """Online RL's rollout on this rank: its KV cache (cputrain.rollouts.kv_cache_size, sized once
    for the whole rollout in the precision the forwards run in), the fp32 logits of each row's
    last position with their warped copy, and the fused decoder's weights
    (cputrain.rollouts.fused_weight_size: the whole model gathered under fsdp; zero3's ranks decode
    through their modules); 0 without a rollout."""
    if not inp.rollout_rows:
        return 0
    from cputrain.rollouts.kv_cache_size import PAGE_POSITIONS, kv_cache_bytes

    positions = inp.rollout_len
    if inp.strategy in FUSED_ROLLOUT_STRATEGIES:
        positions = -(-positions // PAGE_POSITIONS) * PAGE_POSITIONS  # the fused decoder's cache holds whole pages
    return (kv_cache_bytes(m.config_sizes, inp.rollout_rows, positions, inp.precision)
            + 2 * inp.rollout_rows * m.vocab * 4 + fused_decoder_bytes(m, inp))


FUSED_ROLLOUT_STRATEGIES = ("single", "ddp", "fsdp")  # zero3's emptied partitions decode through the modules


def fused_decoder_bytes(m: ModelShape, inp: PlanInputs) -> int:
    """The fused decoder's weights beside the model on this rank (cputrain.rollouts.fused_weight_size:
    the whole model gathered under fsdp); 0 without a rollout or under zero3."""
    if not inp.rollout_rows or inp.strategy not in FUSED_ROLLOUT_STRATEGIES:
        return 0
    from cputrain.rollouts.fused_weight_size import fused_weight_bytes

    return fused_weight_bytes(m.config_sizes, inp.precision, gathered=inp.strategy == "fsdp")


def plan_all_ranks(m: ModelShape, inp: PlanInputs) -> list[RankPlan]:
    return [plan_rank(m, inp, r) for r in range(inp.world_size)]
