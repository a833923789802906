"""How long one optimizer step takes, and how much of it waits on the network.

    compute   (model FLOPs the trainer's MFU counts + the forward of each checkpointed block
              again) × tokens per rank per step ÷ (the rank's peak FLOP/s × the share of it the
              cores reach, measured: cputrain.plan.time.measured_mfu)
    network   each collective's bytes through a node's link (cputrain.plan.time.comm_volume) at
              what the link gives it (cputrain.plan.time.link), and a node's own collectives at
              gloo's CPU rate where it was measured
    exposed   the part of the network time no compute hides (cputrain.plan.time.overlap), and a
              node's own collectives whole; step = compute + exposed
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from cputrain.config import Config, checkpointed_blocks
from cputrain.errors import ConfigError
from cputrain.parallel.fsdp_layouts import DEFAULT_LAYOUT, overlaps_reduction
from cputrain.plan.model_shape import ModelShape
from cputrain.plan.time.comm_volume import KINDS, comm_pattern
from cputrain.plan.time.link import Link, LinkTimer
from cputrain.plan.time.overlap import fsdp_exposed_s, fsdp_overlap_source, modelled_exposed_s


@dataclass(frozen=True)
class StepSettings:
    """The decided settings a time plan reads (a Plan's inputs, or a decided config)."""

    strategy: str
    precision: str
    micro_batch: int
    seq_len: int
    global_batch: int
    activation_checkpointing: bool | int | str
    persistence_threshold: int | None = None  # zero3: DeepSpeed's stage3_param_persistence_threshold (None: 10 × hidden)
    max_reuse_distance: int = 10**9  # zero3: DeepSpeed's stage3_max_reuse_distance
    layout: str = DEFAULT_LAYOUT  # fsdp: parallel.layout, decided
    reduce_dtype: str | None = None  # fsdp: parallel.reduce_dtype, decided (None: fp32)
    reduce_scatter: str = "auto"  # fsdp and zero3: parallel.reduce_scatter (auto: the all-to-all, as on gloo)
    prefetch: bool = False  # fsdp: parallel.prefetch, each block's gather issued one block ahead
    overlap_reduction: bool = False  # fsdp: parallel.overlap_reduction (where the layout allows it: overlaps_reduction)
    extra_forwards: int = 0  # no-grad forwards of the blocks beyond the step's own (KTO's KL sequences: 1)
    rollout_positions: int = 0  # online RL: positions a rank's rollout computes a step (its rows × data.seq_len)

    @classmethod
    def of_config(cls, cfg: Config) -> StepSettings:
        """From a config whose keys are decided (cputrain.training.choices.decide_for_plan)."""
        from cputrain.config.reduction import reduce_scatter_in_use
        from cputrain.config.resolved import as_planned
        from cputrain.objectives.objective import objective_class

        cfg = as_planned(cfg)
        p = cfg.parallel
        fsdp = p.strategy == "fsdp"
        return cls(p.strategy, cfg.hardware.precision, cfg.train.micro_batch_size, cfg.data.seq_len,
                   cfg.train.global_batch_size, cfg.model.activation_checkpointing,
                   layout=p.layout if fsdp else DEFAULT_LAYOUT, reduce_dtype=p.reduce_dtype if fsdp else None,
                   reduce_scatter=reduce_scatter_in_use(p.reduce_scatter, p.backend), prefetch=fsdp and p.prefetch,
                   overlap_reduction=fsdp and p.overlap_reduction,
                   extra_forwards=objective_class(cfg.train.objective).extra_forwards,
                   rollout_positions=_rollout_positions(cfg, cfg.launch.nproc_per_node * cfg.launch.nnodes))

    @classmethod
    def of_plan(cls, plan, global_batch: int) -> StepSettings:
        i = plan.inputs
        return cls(i.strategy, i.precision, i.micro_batch, i.seq_len, global_batch, i.activation_checkpointing,
                   i.persistence_threshold, i.max_reuse_distance, i.layout, i.reduce_dtype, i.reduce_scatter,
                   i.prefetch, i.overlap_reduction, i.extra_forwards, i.rollout_rows * i.rollout_len)


def _rollout_positions(cfg, world_size: int) -> int:
    from cputrain.plan.memory.build import rollout_inputs

    inputs = rollout_inputs(cfg, world_size)
    return inputs.get("rollout_rows", 0) * inputs.get("rollout_len", 0)


# Online RL: each rollout position a rank holds (completions × data.seq_len, an upper bound) takes one
# forward at this share of the training's FLOP rate, measured at ~100M (docs/benchmarks/online-rl.md,
# grpo_step: 3,192 positions sampled in 2.45 s, 3,344 trained in 6.19 s in bf16; 6.83, 11.49 s fp32).
ROLLOUT_RATE_SHARE = {"bf16": 0.80, "fp32": 0.54}
ROLLOUT_RATE_SOURCE = "measured at ~100M, 2-core AVX512-BF16 EPYC (docs/benchmarks/online-rl.md, block grpo_step)"


@dataclass(frozen=True)
class CollectiveTime:
    """One collective of the step (cputrain.plan.time.comm_volume.Collective) on the planned link."""

    kind: str
    what: str
    via: str  # ring; a reduce-scatter: native (gloo's all-reduce) or all_to_all
    span: str  # world | node | across
    rank_bytes: float  # what one rank sends per step
    link_bytes: float  # through one node's link per step, each way
    message_bytes: int
    flows: int  # TCP flows through a node's link
    rate_gbit_s: float  # what those flows get of the link: min(link, flows × per-flow cap)
    efficiency: float  # gloo's share of that rate
    seconds: float


@dataclass
class StepTimePlan:
    world_size: int
    nnodes: int
    micro_batches: int  # per rank per step (the accumulation)
    tokens_per_rank: int  # per step
    model_flops_per_rank: float  # per step, as MFU counts them
    recompute_flops_per_rank: float  # per step: checkpointed blocks' forwards again
    compute_s: float
    comm_bytes_by_kind: dict[str, float]  # one rank's ring volume per step
    link_bytes_by_kind: dict[str, float]  # through one node's link per step, each way
    message_bytes_by_kind: dict[str, int]
    efficiency_by_kind: dict[str, float]
    network_s: float
    exposed_network_s: float  # the link's time no compute hides, and the node's own collectives (in_node_s)
    overlap: float  # share of the network time hidden behind compute
    overlap_source: str  # "given", "modelled", or for FSDP2 "measured on CPU: none hides"
    step_s: float
    tokens_per_s_per_rank: float
    tokens_per_s: float  # the cluster's
    mfu: float
    network_share: float  # exposed network time ÷ step time
    link_gbit_s: float | None
    peak_flops_per_s: float  # one rank's
    whole_parameter_bytes: int  # FSDP/ZeRO-3: every block's and the root's parameters as gathered
    source: dict[str, str] = field(default_factory=dict)  # what the MFU, efficiency and link figures are
    layout: str = ""  # fsdp's parallel.layout
    reduce_dtype: str = ""  # fsdp and zero3: the dtype gradients are reduced in
    reduce_scatter: str = ""  # fsdp and zero3: native (gloo's all-reduce) or all_to_all
    flow_cap_gbit_s: float | None = None  # what one TCP flow gets at most (None: no cap)
    in_node_s: float = 0.0  # a node's own collectives over loopback (planned where gloo_cpu_capped), never hidden
    collectives: list[CollectiveTime] = field(default_factory=list)
    rollout_s: float = 0.0  # online RL: the rollout's prefill and decode, in step_s
    rollout_rate_share: float = 0.0  # the share of the training's FLOP rate it was counted at

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "collectives"}
        out["collectives"] = [asdict(c) for c in self.collectives]
        return out


@dataclass(frozen=True)
class Compute:
    """One rank's cores: `peak_flops_per_s` its theoretical peak (its share of the node's cores:
    cputrain.plan.time.on_instance.rank_peak_flops), `mfu` the share of it the cores run the step's
    FLOPs at, recompute included (a run without activation checkpointing logs it as its MFU),
    `source` what that MFU is."""

    peak_flops_per_s: float
    mfu: float
    source: str = "given"

    def check(self) -> None:
        if not self.peak_flops_per_s > 0:
            raise ConfigError(f"peak FLOP/s must be positive (got {self.peak_flops_per_s})")
        if not 0 < self.mfu <= 1:
            raise ConfigError(f"MFU must be in (0, 1] (got {self.mfu})")

    @property
    def flops_per_s(self) -> float:
        """FLOPs the cores execute per second."""
        return self.peak_flops_per_s * self.mfu


@dataclass(frozen=True)
class TokenFlops:
    """FLOPs per token of one sequence position: the model's (as cputrain.metrics.flops counts them
    for the trainer's MFU), the checkpointed blocks' forwards again, one block's forward and backward."""

    model: float
    recompute: float
    block_forward: float
    block_backward: float


def token_flops(shape: ModelShape, seq_len: int, activation_checkpointing: bool | int | str) -> TokenFlops:
    """The plans' one count of FLOPs per token (the time plan's step, the stop window's)."""
    from cputrain.metrics.flops import flops_per_token

    embed = [p for p in shape.params if "embed_tokens" in p.name]
    # the input lookup is no matmul; a tied head still multiplies by the table (model.skeleton's counts)
    non_embedding = shape.total_params - (0 if shape.tied_embeddings else sum(p.numel for p in embed))
    trained = shape.trainable_params - (0 if shape.tied_embeddings else sum(p.numel for p in embed if p.trainable))
    model = flops_per_token(non_embedding, shape.layers, shape.hidden, seq_len, trained_params=trained)
    layers = max(shape.layers, 1)
    block = sum(p.numel for p in shape.params if p.unit != "root") / layers
    block_trained = sum(p.numel for p in shape.params if p.unit != "root" and p.trainable) / layers
    attention = 4 * shape.hidden * seq_len  # a block's forward share of 12·d·T
    forward = 2 * block + attention
    backward = 2 * block + 2 * block_trained + 2 * attention
    # blocks checkpointed whole run their forward again; selective ones rerun no matmul, only
    # elementwise work the FLOP count leaves out
    checkpointed = checkpointed_blocks(activation_checkpointing, shape.layers)
    return TokenFlops(model, checkpointed * forward, forward, backward)


def step_flops(shape: ModelShape, seq_len: int, global_batch: int,
               activation_checkpointing: bool | int | str) -> float:
    """FLOPs of one optimizer step: the model's and the checkpointed blocks' forwards again."""
    ft = token_flops(shape, seq_len, activation_checkpointing)
    return (ft.model + ft.recompute) * seq_len * global_batch


def _check(s: StepSettings, world_size: int, nproc_per_node: int, compute: Compute, link: Link) -> None:
    if world_size < 1 or nproc_per_node < 1 or world_size % nproc_per_node:
        raise ConfigError(f"world size {world_size} must be a positive multiple of the ranks per node ({nproc_per_node})")
    compute.check()
    link.check()
    if s.global_batch % (s.micro_batch * world_size):
        raise ConfigError(f"train.global_batch_size {s.global_batch} is not a multiple of micro-batch "
                          f"{s.micro_batch} × {world_size} ranks")


def _by_kind(timed: list[CollectiveTime], fixed: float) -> tuple[dict[str, int], dict[str, float]]:
    """By kind, as plan.json had them: the message and efficiency of the kind's largest flow through the link."""
    messages, efficiencies = {}, {}
    for kind in KINDS:
        largest = max((t for t in timed if t.kind == kind), key=lambda t: (t.link_bytes, t.rank_bytes), default=None)
        messages[kind] = largest.message_bytes if largest else 0
        efficiencies[kind] = largest.efficiency if largest else fixed
    return messages, efficiencies


def _timed(timer: LinkTimer) -> list[CollectiveTime]:
    w, n, p = timer.world, timer.nnodes, timer.pattern.ranks_per_node
    return [CollectiveTime(c.kind, c.what, c.via, c.span, c.rank_bytes(w, p), c.link_bytes(w, n), c.message_bytes,
                           c.flows(w, n), timer.rate_gbit_s(c), timer.efficiency(c),
                           timer.seconds(c) + timer.in_node_seconds(c))
            for c in timer.pattern.collectives]


def _exposed_s(s: StepSettings, timer: LinkTimer, timed: list[CollectiveTime], compute_s: float,
               block_s: tuple[float, float]) -> tuple[float, str]:
    """The link's time no compute hides (cputrain.plan.time.overlap's regimes), and its source."""
    network_s = sum(timer.seconds(c) for c in timer.pattern.collectives)
    behind = overlaps_reduction(s.layout, s.overlap_reduction, timer.pattern.reduce_scatter)
    source = ("given" if timer.link.overlap is not None else
              fsdp_overlap_source(s.prefetch, behind) if s.strategy == "fsdp" else "modelled")
    if not timer.planned or network_s == 0:
        return 0.0, source
    if timer.link.overlap is not None:
        return (1 - timer.link.overlap) * network_s, source
    if s.strategy == "fsdp":  # the blocks' gathers through the link: the node's own ones are CPU work
        block_gathers_s = sum(t.seconds for t in timed
                              if t.kind == "all_gather" and t.what.startswith("blocks") and t.link_bytes)
        reduces_s = sum(t.seconds for t in timed if t.kind == "reduce_scatter" and t.link_bytes) if behind else 0.0
        return fsdp_exposed_s(network_s, block_gathers_s, compute_s, s.prefetch, timer.pattern.layers,
                              reduces_s, block_s[1] * (timer.pattern.layers - 1)), source
    allreduce_s = sum(t.seconds for t in timed if t.kind == "all_reduce")
    gloo_cpu_s = sum(timer.cpu_seconds(c) for c in timer.pattern.collectives)
    return modelled_exposed_s(timer, network_s, allreduce_s, gloo_cpu_s, block_s), source


def plan_step_time(s: StepSettings, world_size: int, nproc_per_node: int, shape: ModelShape, compute: Compute,
                   link: Link = Link()) -> StepTimePlan:
    """One optimizer step of `s` (a plan's settings, StepSettings.of_plan; a decided config's,
    StepSettings.of_config) on `world_size` ranks, `nproc_per_node` to a node, each rank's cores
    `compute`, the nodes joined by `link`."""
    _check(s, world_size, nproc_per_node, compute, link)
    nnodes = world_size // nproc_per_node
    micro_batches = s.global_batch // (s.micro_batch * world_size)
    tokens_mb = s.micro_batch * s.seq_len
    tokens = micro_batches * tokens_mb
    ft, rate = token_flops(shape, s.seq_len, s.activation_checkpointing), compute.flops_per_s
    extra_ft = s.extra_forwards * ft.block_forward * shape.layers  # KTO's KL sequences: the blocks' forward, no gradient
    compute_s = (ft.model + ft.recompute + extra_ft) * tokens / rate
    block_s = (ft.block_forward * tokens_mb / rate,
               (ft.block_backward + ft.recompute / max(shape.layers, 1)) * tokens_mb / rate)
    pattern = comm_pattern(shape, s.strategy, s.precision, world_size, micro_batches, nnodes=nnodes,
                           persistence_threshold=(10 * shape.hidden if s.persistence_threshold is None
                                                  else s.persistence_threshold),
                           max_reuse_distance=s.max_reuse_distance, layout=s.layout,
                           reduce_dtype=s.reduce_dtype, reduce_scatter=s.reduce_scatter)
    timer = link.on(pattern, world_size, nnodes)
    source = {"mfu": compute.source, "efficiency": timer.efficiency_source(),
              "link": timer.link_source(s.strategy == "single" or world_size == 1)}
    timed = _timed(timer)
    network_s = sum(timer.seconds(c) for c in pattern.collectives)
    in_node_s = sum(timer.in_node_seconds(c) for c in pattern.collectives)
    in_node_rank_bytes = sum(t.rank_bytes for t in timed if not t.link_bytes)
    if in_node_rank_bytes:
        source["in_node"] = timer.in_node_source(in_node_rank_bytes, in_node_s)
    exposed, overlap_source = _exposed_s(s, timer, timed, compute_s, block_s)
    hidden = 1 - exposed / network_s if network_s else 1.0
    exposed += in_node_s  # gloo's loopback work on the cores the compute uses: none of it hides
    # online RL: one forward a rollout position (the model's FLOPs are forward and backward, 3 forwards)
    rollout_share = ROLLOUT_RATE_SHARE.get(s.precision, ROLLOUT_RATE_SHARE["fp32"])
    rollout_s = s.rollout_positions * ft.model / 3 / (rate * rollout_share)
    step_s = compute_s + exposed + rollout_s
    messages, efficiencies = _by_kind(timed, timer.fixed)
    return StepTimePlan(
        world_size=world_size, nnodes=nnodes, micro_batches=micro_batches, tokens_per_rank=tokens,
        model_flops_per_rank=ft.model * tokens, recompute_flops_per_rank=ft.recompute * tokens,
        compute_s=compute_s, comm_bytes_by_kind=pattern.rank_bytes(world_size),
        link_bytes_by_kind=pattern.link_bytes(world_size, nnodes), message_bytes_by_kind=messages,
        efficiency_by_kind=efficiencies, network_s=network_s, exposed_network_s=exposed, overlap=hidden,
        overlap_source=overlap_source,
        step_s=step_s, tokens_per_s_per_rank=tokens / step_s, tokens_per_s=tokens * world_size / step_s,
        mfu=ft.model * tokens / (step_s * compute.peak_flops_per_s), network_share=exposed / step_s,
        link_gbit_s=link.gbit_s, peak_flops_per_s=compute.peak_flops_per_s,
        whole_parameter_bytes=pattern.whole_parameter_bytes, source=source, layout=pattern.layout,
        reduce_dtype=pattern.reduce_dtype, reduce_scatter=pattern.reduce_scatter,
        flow_cap_gbit_s=link.flow_cap_gbit_s, in_node_s=in_node_s, collectives=timed, rollout_s=rollout_s,
        rollout_rate_share=rollout_share if s.rollout_positions else 0.0)
