"""How long one optimizer step takes, and how much of it waits on the network.

    compute   (model FLOPs the trainer's MFU counts + the forward of each checkpointed block
              again) × tokens per rank per step ÷ (the rank's peak FLOP/s × the share of it the
              cores reach, measured: cputrain.plan.time.measured_mfu)
    network   bytes through a node's link (cputrain.plan.time.comm_volume) ÷ (the rate those
              bytes get × gloo's efficiency for that collective and message size:
              cputrain.plan.time.link_efficiency), collective by collective. The rate is the
              node's link, or less where the collective's TCP flows are capped: a flow gets at most
              flow_cap_gbit_s (EC2's: cputrain.plan.instances), so a node's link carries
              min(link, flows × cap)
    exposed   the part of the network time no compute hides (below); step = compute + exposed

Overlap. FSDP2 on CPU, a gather issued as its block begins, hides none of it: measured over a
shaped link (block gloo_link-runs of docs/benchmarks/network.md), its gathers and reduce-scatters add
to the step whole at every rate (a CPU has no side streams for the gather to run on while a block
computes). Issued one block ahead on gloo's own thread (parallel.prefetch, the default), part of
each block's gather crosses while the block before computes (block fsdp_prefetch): the reduce-
scatters still show whole. ZeRO-3, modelled: DeepSpeed
gathers the next block while the current one computes and reduce-scatters a block's gradients
behind the next block's backward, so each block exposes max(0, its communication − its compute),
plus the first gather of a pass and the last reduce-scatter, which never hide. DDP's bucketed
all-reduce runs behind the last micro-batch's backward, all but its last bucket (measured within
10% at 1 Gbit/s). A measured overlap (the share of network time hidden, 0 to 1) replaces these
where a benchmark has one. Planned for the machine the efficiency table was measured on
(`gloo_cpu_capped`), gloo's CPU time (its bytes at the rate it reached unshaped, times each rank's
share of a core) never hides: it comes out of the cores the compute keeps busy.

A node's own collectives (hybrid's gathers and reduce-scatters, node_reshard's backward gathers,
every collective of a one-node run) use no link, but gloo still runs them over loopback TCP on the
cores: on the measuring machine (`gloo_cpu_capped`) each takes its bytes at the rate gloo reached
there unshaped, times the rank's share of a core, and none of it hides (measured with them:
block fsdp_layouts of docs/benchmarks/network.md, 2 ranks sharing each core). For a cluster's
instances gloo's loopback rate is not measured: their time is not planned, and the plan says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from cputrain.config import Config, checkpointed_blocks
from cputrain.errors import ConfigError
from cputrain.plan.time.comm_volume import KINDS, Collective, CommPattern, comm_pattern
from cputrain.plan.time.link_efficiency import NOT_MEASURED, EfficiencyTable, load_table
from cputrain.plan.model_shape import ModelShape


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
    layout: str = "full_shard"  # fsdp: parallel.layout, decided
    reduce_dtype: str | None = None  # fsdp: parallel.reduce_dtype, decided (None: fp32)
    reduce_scatter: str = "auto"  # fsdp and zero3: parallel.reduce_scatter (auto: the all-to-all, as on gloo)
    prefetch: bool = False  # fsdp: parallel.prefetch, each block's gather issued one block ahead
    extra_forwards: int = 0  # no-grad forwards of the blocks beyond the step's own (KTO's KL sequences: 1)

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
                   layout=p.layout if fsdp else "full_shard", reduce_dtype=p.reduce_dtype if fsdp else None,
                   reduce_scatter=reduce_scatter_in_use(p.reduce_scatter, p.backend), prefetch=fsdp and p.prefetch,
                   extra_forwards=objective_class(cfg.train.objective).extra_forwards)

    @classmethod
    def of_plan(cls, plan, global_batch: int) -> StepSettings:
        i = plan.inputs
        return cls(i.strategy, i.precision, i.micro_batch, i.seq_len, global_batch, i.activation_checkpointing,
                   i.persistence_threshold, i.max_reuse_distance, i.layout, i.reduce_dtype, i.reduce_scatter,
                   i.prefetch, i.extra_forwards)


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

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "collectives"}
        out["collectives"] = [asdict(c) for c in self.collectives]
        return out


def rank_peak_flops_here(precision: str, threads: int) -> float:
    """One rank's theoretical peak on this machine, as the trainer's MFU counts it: the machine's
    peak (cputrain.hardware) × the rank's share of the physical cores."""
    from cputrain.hardware import detect

    hw = detect()
    return hw.peak_flops[precision] * min(1.0, threads / max(1, hw.physical_cores))


def _flops_per_token(shape: ModelShape, seq_len: int, checkpointed: int) -> tuple[float, float, float, float]:
    """(model FLOPs per token as cputrain.metrics.flops counts them, recompute FLOPs per token,
    one block's forward and backward FLOPs per token)."""
    from cputrain.metrics.flops import flops_per_token

    embed = [p for p in shape.params if "embed_tokens" in p.name]
    embed_numel = sum(p.numel for p in embed)
    # the input lookup is no matmul; a tied head still multiplies by the table (model.skeleton's counts)
    non_embedding = shape.total_params - (0 if shape.tied_embeddings else embed_numel)
    trained = shape.trainable_params - (0 if shape.tied_embeddings else sum(p.numel for p in embed if p.trainable))
    model = flops_per_token(non_embedding, shape.layers, shape.hidden, seq_len, trained_params=trained)
    layers = max(shape.layers, 1)
    block = sum(p.numel for p in shape.params if p.unit != "root") / layers
    block_trained = sum(p.numel for p in shape.params if p.unit != "root" and p.trainable) / layers
    attention = 4 * shape.hidden * seq_len  # a block's forward share of 12·d·T
    forward = 2 * block + attention
    backward = 2 * block + 2 * block_trained + 2 * attention
    return model, checkpointed * forward, forward, backward


def _exposed_sharded(p: CommPattern, t_gather: float, t_root_gather: float, t_reduce: float, t_root_reduce: float,
                     fwd_s: float, bwd_s: float) -> float:
    """One gathering micro-batch of FSDP/ZeRO-3: what its communication adds to its compute."""
    layers = p.layers
    # forward: the root's and the first block's gathers wait; each next block's hides behind the one before
    exposed = t_root_gather + t_gather + (layers - 1) * max(0.0, t_gather - fwd_s)
    backward_gather = t_gather * p.backward_gathers / layers  # on average over the blocks
    # backward: a block's gather (if resharded) and the previous block's reduce-scatter share the
    # link behind a block's backward; the first gather and the last reduce-scatters never hide
    exposed += backward_gather + (layers - 1) * max(0.0, backward_gather + t_reduce - bwd_s)
    exposed += t_reduce + t_root_reduce
    return exposed


# gloo's native reduce-scatter sends an all-reduce's bytes, 2(W−1)/W·N, where the efficiency table
# measured it against the ring's (W−1)/W·N: per byte it sends, its share of the rate is twice the
# table's (the time is the same either way).
NATIVE_WIRE_PER_RING_BYTE = 2.0
# The all-to-all reduce-scatter has rows of its own in the table benchmarks/gloo_link.py writes; a
# table without them (one given by the user, an older one) gives it the all-gather's share (a
# collective that also sends each byte once), said "assumed".
ALL_TO_ALL_AS = "all_gather"
# FSDP2's gathers issued one block ahead (parallel.prefetch): the share of the shorter of the
# blocks' gathers and the compute that hides. Measured with benchmarks/fsdp_prefetch.py (block
# fsdp_prefetch of docs/benchmarks/network.md: 2 nodes of one rank on one core each, one thread,
# gloo's thread sharing the core with the compute): 118%, 61% and 47% at 0.25, 0.5 and 1 Gbit/s,
# the median taken. Where a core is left to gloo, more may hide: not measured (2 cores).
PREFETCH_HIDDEN_SHARE = 0.61


def table_row_of(c: Collective, table: EfficiencyTable | None = None) -> tuple[str, float]:
    """(the efficiency table's collective for `c`, the factor on its share) — see above."""
    if c.kind == "reduce_scatter" and c.via == "native":
        return "reduce_scatter", NATIVE_WIRE_PER_RING_BYTE
    if c.kind == "reduce_scatter" and c.via == "all_to_all":
        return ("all_to_all" if table is not None and table.has_rows("all_to_all") else ALL_TO_ALL_AS), 1.0
    return c.kind, 1.0


def node_link_gbit_s(link_gbit_s: float, flows: int, flow_cap_gbit_s: float | None) -> float:
    """What a collective's `flows` TCP flows get of a node's link: each flow at most the cap."""
    if flow_cap_gbit_s is None or flows <= 0:
        return link_gbit_s
    return min(link_gbit_s, flows * flow_cap_gbit_s)


def plan_step_time(s: StepSettings, world_size: int, nproc_per_node: int, shape: ModelShape, *,
                   link_gbit_s: float | None, peak_flops_per_s: float, mfu: float,
                   efficiency: float | EfficiencyTable | None = None, overlap: float | None = None,
                   mfu_source: str = "given", flow_cap_gbit_s: float | None = None, flow_cap_source: str = "",
                   gloo_cpu_capped: bool = False, rank_core_share: float = 1.0) -> StepTimePlan:
    """One optimizer step of `s` (a plan's settings, StepSettings.of_plan; a decided config's,
    StepSettings.of_config) on `world_size` ranks, `nproc_per_node` to a node.

    `peak_flops_per_s`: one rank's theoretical peak (its share of the node's cores; for this
    machine cputrain.hardware.detect().peak_flops[precision] × threads ÷ cores). `mfu`: the share
    of that peak the cores run the step's FLOPs at, recompute included (a run without activation
    checkpointing logs it as its MFU). `link_gbit_s`: each node's link; None plans no network
    time (one node needs none). `efficiency`: gloo's share of the line rate, a number for every
    collective or a measured table; None reads cputrain/plan/time/gloo_link_efficiency.json, or
    assumes 1.0 without it. `overlap`: the share of network time hidden behind compute, 0 to 1
    (None: the model in this module's docstring). `flow_cap_gbit_s`: what one TCP flow gets at
    most (EC2's per-flow limit, cputrain.plan.instances; None: no cap, as on the measuring
    machine's veth), `flow_cap_source` what it is, for the plan's words.
    `gloo_cpu_capped`: the ranks run on the CPU the efficiency table was measured on (one core per
    rank), so gloo's collectives are also limited by what that CPU pushed through unshaped, and
    that CPU time, taken from the cores the compute runs on, is never hidden; `rank_core_share`
    is each rank's share of one core there (the benchmarks' 2 ranks on one core: 0.5)."""
    if world_size < 1 or nproc_per_node < 1 or world_size % nproc_per_node:
        raise ConfigError(f"world size {world_size} must be a positive multiple of the ranks per node ({nproc_per_node})")
    if not peak_flops_per_s > 0:
        raise ConfigError(f"peak FLOP/s must be positive (got {peak_flops_per_s})")
    if not 0 < mfu <= 1:
        raise ConfigError(f"MFU must be in (0, 1] (got {mfu})")
    if link_gbit_s is not None and not link_gbit_s > 0:
        raise ConfigError(f"--link-gbit-s must be a positive number of Gbit/s (got {link_gbit_s})")
    if flow_cap_gbit_s is not None and not flow_cap_gbit_s > 0:
        raise ConfigError(f"the per-flow cap must be a positive number of Gbit/s (got {flow_cap_gbit_s})")
    if not 0 < rank_core_share <= 1:
        raise ConfigError(f"a rank's share of a core must be in (0, 1] (got {rank_core_share})")
    if overlap is not None and not 0 <= overlap <= 1:
        raise ConfigError(f"overlap must be in [0, 1] (got {overlap})")
    if s.global_batch % (s.micro_batch * world_size):
        raise ConfigError(f"train.global_batch_size {s.global_batch} is not a multiple of micro-batch "
                          f"{s.micro_batch} × {world_size} ranks")
    nnodes = world_size // nproc_per_node
    micro_batches = s.global_batch // (s.micro_batch * world_size)
    tokens_mb = s.micro_batch * s.seq_len
    tokens = micro_batches * tokens_mb
    # blocks checkpointed whole run their forward again; selective ones rerun no matmul, only
    # elementwise work the FLOP count leaves out
    checkpointed = checkpointed_blocks(s.activation_checkpointing, shape.layers)
    model_ft, recompute_ft, fwd_ft, bwd_ft = _flops_per_token(shape, s.seq_len, checkpointed)
    rate = peak_flops_per_s * mfu  # FLOPs the cores execute per second
    extra_ft = s.extra_forwards * fwd_ft * shape.layers  # KTO's KL sequences: the blocks' forward, no gradient
    compute_s = (model_ft + recompute_ft + extra_ft) * tokens / rate
    fwd_block_s = fwd_ft * tokens_mb / rate
    bwd_block_s = (bwd_ft + recompute_ft / max(shape.layers, 1)) * tokens_mb / rate

    pattern = comm_pattern(shape, s.strategy, s.precision, world_size, micro_batches, nnodes=nnodes,
                           persistence_threshold=(10 * shape.hidden if s.persistence_threshold is None
                                                  else s.persistence_threshold),
                           max_reuse_distance=s.max_reuse_distance, layout=s.layout,
                           reduce_dtype=s.reduce_dtype, reduce_scatter=s.reduce_scatter)
    rank_bytes = pattern.rank_bytes(world_size)
    link_bytes = pattern.link_bytes(world_size, nnodes)
    source: dict[str, str] = {"mfu": mfu_source}
    if isinstance(efficiency, (int, float)):
        if not 0 < efficiency <= 1.5:
            raise ConfigError(f"efficiency must be in (0, 1.5] (got {efficiency})")
        table, fixed = None, float(efficiency)
        source["efficiency"] = f"given: {fixed:g} of the line rate for every collective"
    else:
        table = efficiency if efficiency is not None else load_table()
        fixed = 1.0
        source["efficiency"] = table.describe(gloo_cpu_capped) if table is not None else NOT_MEASURED
        if table is not None and not table.has_rows("all_to_all") and any(
                c.via == "all_to_all" and c.link_bytes(world_size, nnodes) for c in pattern.collectives):
            source["efficiency"] += ("; the all-to-all reduce-scatter's share assumed: the all-gather's "
                                     "(not measured yet)")
    network_used = nnodes > 1 and any(link_bytes.values())
    if network_used and link_gbit_s is None:
        source["link"] = "no link given: network time not planned"
    elif not network_used:
        source["link"] = ("single: no collectives" if s.strategy == "single" or world_size == 1
                          else "one node: collectives stay in memory, not network-bound")
    else:
        source["link"] = f"{link_gbit_s:g} Gbit/s per node"
        if flow_cap_gbit_s is not None:
            source["link"] += f", one TCP flow at most {flow_cap_gbit_s:g} ({flow_cap_source or 'given'})"
    planned = network_used and link_gbit_s is not None

    def rate_of(c: Collective) -> float:
        return node_link_gbit_s(link_gbit_s, c.flows(world_size, nnodes), flow_cap_gbit_s) if planned else 0.0

    def efficiency_of(c: Collective) -> float:
        if table is None or not planned:
            return fixed
        row, factor = table_row_of(c, table)
        return factor * table.efficiency(row, c.message_bytes, rate_of(c), gloo_cpu_capped, rank_core_share)

    def seconds(c: Collective, nbytes: float) -> float:
        if not planned or nbytes <= 0:
            return 0.0
        return nbytes * 8 / (rate_of(c) * 1e9 * efficiency_of(c))

    def at_gloo_cpu_rate(c: Collective, nbytes: float) -> float:
        """`nbytes` of `c` at the rate gloo reached unshaped on the table's CPU, a rank holding
        rank_core_share of a core: the time gloo's transfers and reductions hold the cores."""
        row, factor = table_row_of(c, table)
        cap = table.cpu_cap_gbit_s(row, c.message_bytes)
        return nbytes * 8 / (factor * cap * rank_core_share * 1e9) if cap and nbytes > 0 else 0.0

    def cpu_seconds(c: Collective, nbytes: float) -> float:
        """A collective through the link: gloo's CPU time for its bytes, where the table's CPU runs it."""
        return at_gloo_cpu_rate(c, nbytes) if planned and gloo_cpu_capped and table else 0.0

    def in_node_seconds(c: Collective, planned_here: bool = gloo_cpu_capped) -> float:
        """A collective that crosses no link: what one rank sends over loopback, at gloo's CPU rate."""
        if c.link_bytes(world_size, nnodes) or not (planned_here and table):
            return 0.0
        return at_gloo_cpu_rate(c, c.rank_bytes(world_size, pattern.ranks_per_node))

    link_s = [seconds(c, c.link_bytes(world_size, nnodes)) for c in pattern.collectives]
    node_s = [in_node_seconds(c) for c in pattern.collectives]
    timed = [CollectiveTime(c.kind, c.what, c.via, c.span, c.rank_bytes(world_size, pattern.ranks_per_node),
                            c.link_bytes(world_size, nnodes), c.message_bytes, c.flows(world_size, nnodes),
                            rate_of(c), efficiency_of(c), through_link + in_node)
             for c, through_link, in_node in zip(pattern.collectives, link_s, node_s)]
    network_s, in_node_s = sum(link_s), sum(node_s)
    in_node_rank_bytes = sum(t.rank_bytes for t in timed if not t.link_bytes)
    if in_node_rank_bytes and not in_node_s:
        source["in_node"] = (f"{in_node_rank_bytes / 2**30:,.1f} GiB a rank per step in the node's own collectives: not "
                             "planned (gloo's loopback rate on this CPU kind is not measured")
        at_measured_s = sum(in_node_seconds(c, planned_here=True) for c in pattern.collectives)
        if at_measured_s:  # what they would take at the one core per rank the table was measured on: a bound
            source["in_node"] += f"; at the rate one {table.machine.split(',')[0]} core reached, {at_measured_s:,.0f} s"
        source["in_node"] += ")"
    gloo_cpu_s = sum(cpu_seconds(c, t.link_bytes) for c, t in zip(pattern.collectives, timed))
    # by kind, as plan.json had them: the message and efficiency of the kind's largest flow through the link
    messages, efficiencies = {}, {}
    for kind in KINDS:
        of_kind = [t for t in timed if t.kind == kind]
        largest = max(of_kind, key=lambda t: (t.link_bytes, t.rank_bytes), default=None)
        messages[kind] = largest.message_bytes if largest else 0
        efficiencies[kind] = largest.efficiency if largest else fixed
    if not planned or network_s == 0:
        exposed = 0.0
    elif overlap is not None:
        exposed = (1 - overlap) * network_s
    elif s.strategy == "fsdp":
        # FSDP2 on CPU: measured, a gather issued as its block begins and the gradients'
        # reduce-scatter show in the step whole at every link rate (block gloo_link-runs of
        # docs/benchmarks/network.md). Issued one block ahead (parallel.prefetch), part of each
        # block's gather crosses while the block before computes: PREFETCH_HIDDEN_SHARE of the
        # shorter of the two, measured (block fsdp_prefetch); the first gather of each pass waits.
        exposed = network_s
        if s.prefetch:
            layers = max(shape.layers, 1)
            block_gathers_s = sum(t.seconds for t in timed  # through the link: the node's own ones are CPU work
                                  if t.kind == "all_gather" and t.what.startswith("blocks") and t.link_bytes)
            exposed -= PREFETCH_HIDDEN_SHARE * min(block_gathers_s * (layers - 1) / layers, compute_s)
    else:
        exposed = 0.0
        if pattern.gathering_micro_batches:
            def per_call(kind: str, whole: int) -> float:  # one collective across the nodes
                one = Collective(kind, "", whole, whole, via=pattern.reduce_scatter if kind == "reduce_scatter"
                                 else "ring")
                return seconds(one, one.link_bytes(world_size, nnodes))

            one = _exposed_sharded(pattern, per_call("all_gather", pattern.block_gather_bytes),
                                   per_call("all_gather", pattern.root_gather_bytes),
                                   per_call("reduce_scatter", pattern.block_reduce_bytes),
                                   per_call("reduce_scatter", pattern.root_reduce_bytes), fwd_block_s, bwd_block_s)
            exposed += one * pattern.gathering_micro_batches
        if pattern.allreduce_bytes:
            allreduce_s = sum(t.seconds for t in timed if t.kind == "all_reduce")
            buckets = max(1.0, pattern.allreduce_bytes / max(pattern.allreduce_message_bytes, 1))
            last_bucket = allreduce_s / buckets
            backward_s = bwd_block_s * max(shape.layers, 1)
            exposed += last_bucket + max(0.0, allreduce_s - last_bucket - backward_s)
        exposed = min(exposed, network_s)
        # gloo's own CPU time comes out of the cores the compute saturates: it never hides; the
        # rest of the wait (the link's) hides as the model above says
        if gloo_cpu_s:
            exposed = gloo_cpu_s + (network_s - gloo_cpu_s) * exposed / network_s
    hidden = 1 - exposed / network_s if network_s else 1.0
    exposed += in_node_s  # gloo's loopback work on the cores the compute uses: none of it hides
    step_s = compute_s + exposed
    return StepTimePlan(
        world_size=world_size, nnodes=nnodes, micro_batches=micro_batches, tokens_per_rank=tokens,
        model_flops_per_rank=model_ft * tokens, recompute_flops_per_rank=recompute_ft * tokens,
        compute_s=compute_s, comm_bytes_by_kind=rank_bytes, link_bytes_by_kind=link_bytes,
        message_bytes_by_kind=messages, efficiency_by_kind=efficiencies, network_s=network_s,
        exposed_network_s=exposed, overlap=hidden, overlap_source=(
            "given" if overlap is not None
            else (f"FSDP2 on CPU, gathers issued a block ahead: {PREFETCH_HIDDEN_SHARE:.0%} of the shorter of the "
                  "blocks' gathers and the compute hides, measured" if s.prefetch else
                  "FSDP2 on CPU, gathers issued as their block begins, measured: none hides")
            if s.strategy == "fsdp" else "modelled"),
        step_s=step_s, tokens_per_s_per_rank=tokens / step_s, tokens_per_s=tokens * world_size / step_s,
        mfu=model_ft * tokens / (step_s * peak_flops_per_s), network_share=exposed / step_s,
        link_gbit_s=link_gbit_s, peak_flops_per_s=peak_flops_per_s,
        whole_parameter_bytes=pattern.whole_parameter_bytes, source=source,
        layout=pattern.layout, reduce_dtype=pattern.reduce_dtype, reduce_scatter=pattern.reduce_scatter,
        flow_cap_gbit_s=flow_cap_gbit_s, in_node_s=in_node_s, collectives=timed)
