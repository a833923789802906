"""What would change a step that waits on the network, each figure re-planned by
cputrain.plan.time.step_time with one setting changed: a larger micro-batch (more tokens per gather)
and fewer, bigger nodes. The FSDP layouts (parallel.layout) are not remedies here: `cputrain plan`
prints every layout on every instance type beside the plan (cputrain.plan.layouts.table), and
parallel.layout=auto takes the fastest that fits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cputrain.parallel.fsdp_layouts import DEFAULT_LAYOUT, layout_error
from cputrain.plan.memory.fit import fits, pod_memory_bytes
from cputrain.plan.instances import Instance
from cputrain.plan.time.link import Link
from cputrain.plan.time.on_instance import rank_peak_flops
from cputrain.plan.time.step_time import Compute, StepSettings, StepTimePlan, plan_step_time

# Above this share of the step spent waiting on the network, the plan lists its remedies.
NETWORK_SHARE_ADVICE = 0.25


@dataclass(frozen=True)
class Remedy:
    setting: str  # what to change, as a user would write it
    plan: StepTimePlan
    note: str = ""

    def line(self, now: StepTimePlan) -> str:
        speedup = self.plan.tokens_per_s / now.tokens_per_s
        return (f"{self.setting}: {self.plan.tokens_per_s:,.0f} tokens/s ({speedup:.2f}×), network "
                f"{self.plan.network_share:.0%} of the step{'; ' + self.note if self.note else ''}")


def remedies(settings: StepSettings, shape, world_size: int, nproc_per_node: int, now: StepTimePlan, *,
             instance: Instance | None, rank_peak_bytes: int | None, compute: Compute, link: Link,
             memory_of=None, candidates: list[Instance] | None = None) -> list[Remedy]:
    """The remedies for the step `now` (planned on `compute` and `link`), each planned with the
    same MFU, efficiency and overlap, on a bigger node at its rank's peak FLOP/s.
    `memory_of(**plan_inputs_changes)`: a rank's peak bytes with those inputs changed (the memory
    plan), for saying whether a remedy still fits the instance. `candidates`: the instance table
    bigger nodes are taken from (default: the built-in one)."""
    if now.network_share <= NETWORK_SHARE_ADVICE:
        return []
    out: list[Remedy] = []

    def fit_note(extra: dict, added_bytes: int = 0, what: str = "") -> str:
        if memory_of is None or instance is None:
            return what
        peak = memory_of(**extra) + added_bytes
        pod_gib = pod_memory_bytes(peak, nproc_per_node) / 2**30
        verdict = "fits" if fits(instance, peak, nproc_per_node) else "does not fit"
        return f"{what + ', ' if what else ''}{pod_gib:,.1f} GiB a pod: {verdict} {instance.name}"

    def again(s=settings, nproc=nproc_per_node, link_gbit_s=link.gbit_s, peak=compute.peak_flops_per_s):
        return plan_step_time(s, world_size, nproc, shape, replace(compute, peak_flops_per_s=peak),
                              replace(link, gbit_s=link_gbit_s))

    # more tokens per gather: the same global batch in fewer, larger micro-batches
    if now.micro_batches > 1:
        bigger = replace(settings, micro_batch=settings.micro_batch * 2)
        out.append(Remedy(f"train.micro_batch_size={bigger.micro_batch}", again(bigger),
                          fit_note({"micro_batch": bigger.micro_batch})))
    nnodes = world_size // nproc_per_node
    if instance is not None and nnodes > 1 and rank_peak_bytes is not None:
        # fewer, bigger nodes: half the nodes, twice the ranks on each, the same family
        fewer = nnodes // 2
        if fewer >= 1 and world_size % fewer == 0:
            ranks = world_size // fewer
            from cputrain.plan.instances import builtin_instances

            bigger = [i for i in (candidates or builtin_instances()) if i.family == instance.family
                      and i.vcpus >= instance.vcpus and fits(i, rank_peak_bytes, ranks)]
            if bigger:
                node = min(bigger, key=lambda i: i.vcpus)
                # the same layout where the fewer nodes admit it, else FSDP2's default
                s = settings if layout_error(settings.layout, world_size, ranks) is None else replace(
                    settings, layout=DEFAULT_LAYOUT)
                plan = again(s, nproc=ranks, link_gbit_s=node.network_gbit_s if fewer > 1 else link.gbit_s,
                             peak=rank_peak_flops(settings.precision, instance=node, ranks_per_node=ranks))
                cost = (f"{fewer * node.price_per_hour / 3600 / plan.tokens_per_s * 1e6:,.2f} USD per million tokens"
                        if node.price_per_hour else "")
                out.append(Remedy(f"--nnodes {fewer} --nproc-per-node {ranks} on {node.name}", plan, cost))
    return out
