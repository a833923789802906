"""parallel.layout=auto: the fastest FSDP layout by the time plan among those whose memory plan
fits each rank.

Every layout the world and its ranks per node admit (cputrain.parallel.fsdp_layouts.layout_error)
is planned twice: its memory per rank (cputrain.plan.memory, the layout's buffers and shards) and
its step (cputrain.plan.time.step_time, the layout's collectives on the link). Of those that fit,
the one with the shortest step; at equal steps (no link rate known: no network time planned), the
fewest bytes through a node's link, then the order of LAYOUTS (full_shard first). One node is no
exception: no byte crosses a link there, but the layouts still differ in what a sharded rank's own
work costs (cputrain.plan.time.sharded_compute: gather_once casts and gathers once a step) and in
the node's own collectives, so the fastest that fits is chosen there too; where their steps tie
(the allocator's factors equal, no loopback rate measured), full_shard, the least memory. Where
none fits, full_shard too, and the reason says by how much it is over.

Where it fits is the caller's: in a plan, each pod's share of the instance the plan sizes (the
cluster fit's rule, cputrain.plan.memory.fit); in a run, the rank's share of the node's memory
with checkpointing's margin (cputrain.plan.memory.checkpointing.MEMORY_FRACTION). A run knows no
link rate: it plans on the smallest built-in instance's link (RUN_NETWORK), outside a placement
group, and says so; its compute is its own node's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cputrain.parallel.fsdp_layouts import DEFAULT_LAYOUT, LAYOUTS, layout_error
from cputrain.plan.instances import Instance
from cputrain.plan.time import (RUN_NETWORK, Compute, Network, StepSettings, StepTimePlan, plan_step_time,
                                rank_peak_flops, step_on_instance)

GIB = 2**30


@dataclass(frozen=True)
class LayoutFigures:
    layout: str
    peak_rank_bytes: int  # the memory plan's peak rank
    fits: bool
    step: StepTimePlan

    @property
    def link_bytes(self) -> float:
        return sum(self.step.link_bytes_by_kind.values())


def admissible_layouts(world_size: int, ranks_per_node: int) -> list[str]:
    return [layout for layout in LAYOUTS if layout_error(layout, world_size, ranks_per_node) is None]


def with_layout(cfg, layout: str):
    """`cfg` (fsdp, every other key a plan reads decided) with parallel.layout set."""
    return cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"layout": layout})})


def plans_by_layout(base, ranks_per_node: int, layouts: list[str] | None = None, **changes) -> dict:
    """The memory plan `base` (a cputrain.plan.memory.build.Plan) in each layout its world admits
    (or `layouts`), with its other inputs as they are or as `changes` sets them."""
    from dataclasses import replace

    from cputrain.plan.memory.build import Plan
    from cputrain.plan.memory.estimate import plan_all_ranks

    world = changes.get("world_size", base.inputs.world_size)
    out = {}
    for layout in layouts or admissible_layouts(world, ranks_per_node):
        inputs = replace(base.inputs, layout=layout, ranks_per_node=ranks_per_node, **changes)
        out[layout] = Plan(base.shape, inputs, plan_all_ranks(base.shape, inputs), None, [])
    return out


def figures_on_instance(plans: dict, global_batch: int, instance: Instance, ranks_per_node: int,
                        network: Network) -> list[LayoutFigures]:
    """Each layout's plan on nodes of `instance`: whether a pod of `ranks_per_node` ranks fits it
    (cputrain.plan.memory.fit), and its step there."""
    from cputrain.plan.memory.fit import fits

    out = []
    for layout, plan in plans.items():
        peak = plan.peak_rank.total_bytes
        step, _ = step_on_instance(plan, global_batch, instance, ranks_per_node, network)
        out.append(LayoutFigures(layout, peak, fits(instance, peak, ranks_per_node), step))
    return out


def figures_here(plans: dict, global_batch: int, ranks_per_node: int, fits: Callable[[int], bool],
                 compute_of: Callable[[str], Compute], network: Network = RUN_NETWORK) -> list[LayoutFigures]:
    """Each layout's plan on a running node: `fits(peak rank bytes)`, `compute_of(layout)` the
    rank's own peak and MFU in that layout, and `network` (a run knows no link: RUN_NETWORK)."""
    link = network.link(network.link_gbit_s)
    out = []
    for layout, plan in plans.items():
        step = plan_step_time(StepSettings.of_plan(plan, global_batch), plan.inputs.world_size, ranks_per_node,
                              plan.shape, compute_of(layout), link)
        peak = plan.peak_rank.total_bytes
        out.append(LayoutFigures(layout, peak, fits(peak), step))
    return out


def fastest(figures: list[LayoutFigures]) -> LayoutFigures:
    """The shortest step; at equal steps the fewest bytes through the link, then LAYOUTS' order."""
    return min(figures, key=lambda f: (round(f.step.step_s, 9), f.link_bytes, LAYOUTS.index(f.layout)))


def _figure(f: LayoutFigures) -> str:
    # on one node the share is the node's own collectives over loopback: no byte is on a network
    what = "network" if f.step.nnodes > 1 else "collectives over loopback"
    return (f"{f.layout} {f.step.tokens_per_s:,.0f} tokens/s, {what} {f.step.network_share:.0%} of the step, "
            f"{f.peak_rank_bytes / GIB:,.1f} GiB a rank")


def layout_choice(figures: list[LayoutFigures], where: str, how: str) -> tuple[str, str]:
    """parallel.layout and why. `figures`: each admissible layout's; `where`: what a rank must fit
    in, `how`: what the time plan assumed (for the words)."""
    by_name = {f.layout: f for f in figures}
    full = by_name[DEFAULT_LAYOUT]
    fitting = [f for f in figures if f.fits]
    if not fitting:
        return DEFAULT_LAYOUT, (f"no layout's memory plan fits {where}: full_shard, the least "
                              f"({full.peak_rank_bytes / GIB:,.1f} GiB a rank; `cputrain plan` shows what fits)")
    best = fastest(fitting)
    others = [(_figure(f) if f.fits else f"{f.layout} does not fit ({f.peak_rank_bytes / GIB:,.1f} GiB a rank)")
              for f in figures if f is not best]
    return best.layout, (f"the fastest by the time plan ({how}) of the layouts that fit {where}: {_figure(best)}"
                         + (f"; {'; '.join(others)}" if others else ""))


def least_memory_checkpointing(cfg):
    """`cfg` with model.activation_checkpointing=auto planned as every block checkpointed, the
    least memory (the walk decides it after the layout, for it)."""
    if cfg.model.activation_checkpointing != "auto":
        return cfg
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"activation_checkpointing": True})})


def full_shard_fit(cfg, world_size: int, ranks_per_node: int | None, instances: list[Instance], *,
                   config_json: str | None = None, vocab_size: int | None = None):
    """The memory plan of `cfg` under full_shard (the least memory of the layouts; a reduce dtype
    not decided yet planned as fp32, the more) with the cluster it fits on `instances`: the
    instance a plan's layout is chosen on, and its ranks per node where none are given."""
    from cputrain.plan.memory.build import make_plan

    planned = with_layout(least_memory_checkpointing(cfg), DEFAULT_LAYOUT)
    if planned.parallel.reduce_dtype == "auto":
        planned = planned.model_copy(update={"parallel": planned.parallel.model_copy(update={"reduce_dtype": "fp32"})})
    return make_plan(planned, world_size, nproc_per_node=ranks_per_node, instances=instances,
                     config_json=config_json, vocab_size=vocab_size)


def layout_on_instance(cfg, base, network: Network) -> tuple[str, str]:
    """parallel.layout for a plan: `base` is full_shard_fit's plan (its instance, ranks per node
    and shape); each layout with `cfg`'s reduce dtype, on that instance's link."""
    fit = base.fit
    per_node, nnodes = fit.nproc_per_node, fit.nnodes
    plans = plans_by_layout(base, per_node, reduce_dtype=cfg.parallel.reduce_dtype)
    figures = figures_on_instance(plans, cfg.train.global_batch_size, fit.instance, per_node, network)
    link = network.link_of(fit.instance)
    where = f"a pod of {per_node} rank(s) on {fit.instance.name} ({fit.allocatable_gib:.1f} GiB allocatable)"
    if nnodes <= 1:
        how = f"one {fit.instance.name}: no collective crosses a link"
    else:
        how = (f"{nnodes} × {fit.instance.name}, "
               + (f"{link:g} Gbit/s links" if link else "no link rate known: no network time planned")
               + (", in a cluster placement group" if network.placement_group else ""))
    return layout_choice(figures, where, how)


def layout_on_node(cfg, world_size: int, ranks_per_node: int, hw, vocab_size: int | None) -> tuple[str, str]:
    """parallel.layout for a run: each layout's plan on this node (`hw`: its memory, cores and
    peak), each rank's share fitting the node's memory by the plan's pod rule (× 1.1), on
    RUN_NETWORK."""
    from cputrain.plan.memory.build import make_plan
    from cputrain.plan.memory.fit import pod_memory_bytes
    from cputrain.plan.time import cpu_kind, measured_compute, measured_mfu, running_allocator

    nnodes = world_size // max(ranks_per_node, 1)
    base = make_plan(with_layout(least_memory_checkpointing(cfg), DEFAULT_LAYOUT), world_size,
                     nproc_per_node=ranks_per_node, vocab_size=vocab_size)
    precision = cfg.hardware.precision
    peak = rank_peak_flops(precision, hw=hw, threads=cfg.hardware.threads)
    mfu = measured_mfu(precision, cpu_kind(hw.flags), cfg.model.lora.enabled)
    memory_bytes = hw.memory_gib * GIB
    allocator = running_allocator(cfg)  # a sharded rank's speed depends on it (plan.time.sharded_compute)
    figures = figures_here(plans_by_layout(base, ranks_per_node), cfg.train.global_batch_size, ranks_per_node,
                           lambda peak_bytes: pod_memory_bytes(peak_bytes, ranks_per_node) <= memory_bytes,
                           lambda layout: measured_compute(peak, mfu, "fsdp", layout, allocator, precision))
    where = f"this node's {hw.memory_gib:.1f} GiB with {ranks_per_node} rank(s) (the plan's pod rule: each × 1.1)"
    how = ("this node alone: no collective crosses a link" if nnodes <= 1 else
           f"{nnodes} nodes like this one, each on a {RUN_NETWORK.link_gbit_s:g} Gbit/s link: a run knows no "
           "link rate, so the smallest built-in instance's, outside a placement group")
    return layout_choice(figures, where, how)
