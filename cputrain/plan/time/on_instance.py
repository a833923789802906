"""A memory plan's step on an instance type: one rank's share of its peak, the MFU measured for
its CPU, its link (or the one given) and EC2's per-flow cap (in a cluster placement group or not).
What `cputrain plan`'s time plan, its layout table and parallel.layout=auto in a plan each ask."""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.plan.instances import Instance, flow_cap
from cputrain.plan.time.measured_mfu import MfuChoice, measured_mfu
from cputrain.plan.time.step_time import StepSettings, StepTimePlan, plan_step_time


@dataclass(frozen=True)
class Network:
    """What a plan assumes of the nodes' network."""

    link_gbit_s: float | None = None  # None: each instance's published bandwidth
    placement_group: bool = False  # the nodes in one cluster placement group (EC2's per-flow cap 10, not 5 Gbit/s)

    def link_of(self, instance: Instance) -> float | None:
        return self.link_gbit_s if self.link_gbit_s is not None else instance.network_gbit_s


def instance_rank_peak(instance: Instance, precision: str, ranks_per_node: int) -> float:
    """One rank's share of the instance's theoretical peak (its cores split evenly)."""
    from cputrain.plan.time.stop_window import instance_peak_flops

    return instance_peak_flops(instance, precision) / ranks_per_node


def mfu_on(instance: Instance, precision: str, lora: bool) -> MfuChoice:
    return measured_mfu(precision, "amx" if instance.amx else "avx512", lora)


def step_on_instance(plan, global_batch: int, instance: Instance, ranks_per_node: int,
                     network: Network) -> tuple[StepTimePlan, MfuChoice]:
    """The step of memory plan `plan` on nodes of `instance`, `ranks_per_node` to a node."""
    settings = StepSettings.of_plan(plan, global_batch)
    choice = mfu_on(instance, settings.precision, plan.shape.lora)
    cap, cap_source = flow_cap(network.placement_group)
    step = plan_step_time(settings, plan.inputs.world_size, ranks_per_node, plan.shape,
                          link_gbit_s=network.link_of(instance),
                          peak_flops_per_s=instance_rank_peak(instance, settings.precision, ranks_per_node),
                          mfu=choice.row.executed_share_of_peak, mfu_source=choice.describe(),
                          flow_cap_gbit_s=cap, flow_cap_source=cap_source)
    return step, choice
