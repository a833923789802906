"""The time plan as `cputrain plan` prints it and writes it into plan.json: the step's compute,
its communication per collective, what the network adds, tokens/s, MFU, cost per million tokens,
and the remedies where the network dominates (cputrain.plan.time.advice)."""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.plan.instances import Instance
from cputrain.plan.time.advice import NETWORK_SHARE_ADVICE, Remedy, remedies
from cputrain.plan.time.measured_mfu import MfuChoice
from cputrain.plan.time.on_instance import Network, step_on_instance
from cputrain.plan.time.step_time import CollectiveTime, Compute, StepSettings, StepTimePlan

GB = 1e9


def rank_peak_bytes(plan, **changes) -> int:
    """The memory plan's peak rank with some of its inputs changed (micro-batch, world size)."""
    from dataclasses import replace

    from cputrain.plan.memory.estimate import plan_all_ranks

    return max(r.total_bytes for r in plan_all_ranks(plan.shape, replace(plan.inputs, **changes)))


@dataclass
class TimePlan:
    step: StepTimePlan
    mfu: MfuChoice
    instance: Instance | None
    advice: list[Remedy]

    @property
    def usd_per_million_tokens(self) -> float | None:
        if self.instance is None or self.instance.price_per_hour is None:
            return None
        cluster_usd_per_s = self.instance.price_per_hour * self.step.nnodes / 3600
        return cluster_usd_per_s / self.step.tokens_per_s * 1e6


def time_plan(plan, global_batch: int, instance: Instance | None, nproc_per_node: int,
              link_gbit_s: float | None, candidates: list[Instance] | None = None,
              placement_group: bool = False) -> TimePlan | None:
    """The time plan of a memory plan on `instance` (None: no instance, nothing planned), its link
    `link_gbit_s` or else the instance's published bandwidth, in a cluster placement group or not
    (EC2's per-flow cap); `candidates`: the instance table the advice may take bigger nodes from."""
    if instance is None:
        return None
    network = Network(link_gbit_s, placement_group)
    step, choice = step_on_instance(plan, global_batch, instance, nproc_per_node, network)
    settings = StepSettings.of_plan(plan, global_batch)
    advice = remedies(settings, plan.shape, plan.inputs.world_size, nproc_per_node, step, instance=instance,
                      rank_peak_bytes=plan.peak_rank.total_bytes,
                      compute=Compute(step.peak_flops_per_s, choice.row.executed_share_of_peak, choice.describe()),
                      link=network.link(network.link_of(instance)),
                      memory_of=lambda **changes: rank_peak_bytes(plan, **changes), candidates=candidates)
    return TimePlan(step, choice, instance, advice)


def _s(seconds: float) -> str:
    return f"{seconds:10.1f} s" if seconds >= 10 else f"{seconds:10.3f} s"


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:,.2f} GB"


_VIA = {"native": "gloo's own (an all-reduce, then a slice)", "all_to_all": "all-to-all", "": ""}


def _collective(c: CollectiveTime) -> str:
    how = f"{_VIA[c.via].split(' (')[0]}, " if c.kind == "reduce_scatter" else ""
    where = (f"{_gb(c.link_bytes)} through each node's link in {c.flows} flow{'s' if c.flows != 1 else ''}"
             + (f" at {c.rate_gbit_s:g} Gbit/s, efficiency {c.efficiency:.2f}, {_s(c.seconds).strip()}"
                if c.seconds else "")) if c.link_bytes else "none through a link"
    return (f"{c.kind.replace('_', '-'):<16} {_gb(c.rank_bytes):>12} per rank, {how}{where}; messages of "
            f"{c.message_bytes / 2**20:,.1f} MiB: {c.what}")


def time_lines(tp: TimePlan) -> list[str]:
    s = tp.step
    heading = (f"time per optimizer step ({s.nnodes} × {tp.instance.name}, {s.world_size} rank(s), "
               f"{s.micro_batches} micro-batch(es) of {s.tokens_per_rank // s.micro_batches:,} tokens per rank):")
    lines = ["", heading]
    lines.append(f"  compute          {_s(s.compute_s)}   {(s.model_flops_per_rank + s.recompute_flops_per_rank) / 1e12:,.1f} "
                 f"TFLOP per rank ({s.recompute_flops_per_rank / 1e12:,.1f} of them recomputed blocks) at "
                 f"{s.peak_flops_per_s / 1e12:,.1f} TFLOP/s peak per rank")
    lines.append(f"  MFU assumed      {s.source['mfu']}")
    if s.layout:
        lines.append(f"  layout           parallel.layout={s.layout}, gradients reduced in {s.reduce_dtype}, "
                     f"reduce-scatter {_VIA[s.reduce_scatter]}")
    for c in s.collectives:
        lines.append(f"  {_collective(c)}")
    if not s.collectives:
        lines.append("  communication    none")
    if s.network_s > 0:
        lines.append(f"  network          {_s(s.network_s)}   ({s.source['link']}; {s.source['efficiency']})")
        lines.append(f"  exposed network  {_s(s.exposed_network_s)}   ({s.overlap:.0%} hidden behind compute, "
                     f"{s.overlap_source})")
    else:
        lines.append(f"  network          {_s(0)}   ({s.source['link']})")
    if s.in_node_s:
        lines.append(f"  in the node      {_s(s.in_node_s)}   ({s.source['in_node']})")
    elif "in_node" in s.source:
        lines.append(f"  in the node      {s.source['in_node']}")
    if s.rollout_s:
        from cputrain.plan.time.step_time import ROLLOUT_RATE_SOURCE
        lines.append(f"  rollout          {_s(s.rollout_s)}   (online RL: one forward a sampled position, at "
                     f"{s.rollout_rate_share:.0%} of the training's FLOP rate, {ROLLOUT_RATE_SOURCE})")
    lines.append(f"  step             {_s(s.step_s)}   network {s.network_share:.0%} of it; "
                 f"{s.tokens_per_s_per_rank:,.0f} tokens/s per rank, {s.tokens_per_s:,.0f} for the cluster; "
                 f"MFU {s.mfu:.1%}")
    cost = tp.usd_per_million_tokens
    if cost is not None:
        lines.append(f"  cost             {cost:,.3g} USD per million tokens at {tp.instance.price_per_hour:g} USD/h "
                     f"a node (on-demand list price, us-east-1: check it)")
    if tp.advice:
        lines.append(f"network over {NETWORK_SHARE_ADVICE:.0%} of the step; re-planned with one setting changed:")
        lines += [f"  - {r.line(s)}" for r in tp.advice]
    return lines


def summary_line(tp: TimePlan) -> str:
    """One line for `cputrain k8s`: the step, its network share, tokens/s and cost."""
    s, cost = tp.step, tp.usd_per_million_tokens
    return (f"time plan: step ~{s.step_s:,.0f} s on {s.nnodes} × {tp.instance.name}, network {s.network_share:.0%} "
            f"of it, {s.tokens_per_s:,.0f} tokens/s" + (f", {cost:,.2f} USD per million tokens" if cost else "")
            + f" (MFU {tp.mfu.row.mfu:.1%} from block {tp.mfu.row.block}; `cputrain plan` shows the whole plan)")


def time_document(tp: TimePlan) -> dict:
    s = tp.step
    doc = {k: v for k, v in s.as_dict().items()}
    doc["instance_type"] = tp.instance.name
    doc["usd_per_million_tokens"] = tp.usd_per_million_tokens
    doc["advice"] = [{"setting": r.setting, "tokens_per_s": r.plan.tokens_per_s,
                      "step_s": r.plan.step_s, "network_share": r.plan.network_share, "note": r.note}
                     for r in tp.advice]
    return doc
