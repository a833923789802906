"""A memory plan's step on an instance type: one rank's share of its peak, the MFU measured for
its CPU, its link (or the one given) and EC2's per-flow cap (in a cluster placement group or not).
What `cputrain plan`'s time plan, its layout table and parallel.layout=auto in a plan each ask."""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.hardware import detect, peak_flops
from cputrain.plan.instances import NETWORK_GBIT_S, Instance, flow_cap
from cputrain.plan.time.link import Link
from cputrain.plan.time.measured_mfu import MfuChoice, measured_mfu
from cputrain.plan.time.sharded_compute import IMAGE_ALLOCATOR, measured_compute
from cputrain.plan.time.step_time import StepSettings, StepTimePlan, plan_step_time

# Sapphire Rapids' all-core turbo on c7i/m7i/r7i; the per-cycle rates come from cputrain.hardware.
ASSUMED_CLOCK_GHZ = 3.2


@dataclass(frozen=True)
class Network:
    """What a plan assumes of the nodes' network."""

    link_gbit_s: float | None = None  # None: each instance's published bandwidth
    placement_group: bool = False  # the nodes in one cluster placement group (EC2's per-flow cap 10, not 5 Gbit/s)

    def link_of(self, instance: Instance) -> float | None:
        return self.link_gbit_s if self.link_gbit_s is not None else instance.network_gbit_s

    def link(self, gbit_s: float | None) -> Link:
        """A link of `gbit_s` per node, its TCP flows capped as EC2 caps them in or outside a placement group."""
        cap, cap_source = flow_cap(self.placement_group)
        return Link(gbit_s, flow_cap_gbit_s=cap, flow_cap_source=cap_source)


# A run's link: the smallest built-in instance's (8xlarge), EC2's per-flow cap outside a placement group.
RUN_NETWORK = Network(NETWORK_GBIT_S["8xlarge"], placement_group=False)


def rank_peak_flops(precision: str, *, instance: Instance | None = None, ranks_per_node: int = 1, hw=None,
                    threads: int = 1) -> float:
    """One rank's theoretical peak FLOP/s, as the trainer's MFU counts it. On nodes of `instance`:
    the instance's peak (AVX-512 with two FMA pipes on every built-in family, AMX where the table
    says so) split evenly over `ranks_per_node`. Else on this machine (`hw`, default
    cputrain.hardware.detect()): its peak × the rank's `threads` share of the physical cores."""
    if instance is not None:
        flags = {"avx512f": True, "fma": True, "amx_bf16": instance.amx}
        return peak_flops(flags, instance.physical_cores, ASSUMED_CLOCK_GHZ)[0][precision] / ranks_per_node
    hw = hw if hw is not None else detect()
    return hw.peak_flops[precision] * min(1.0, threads / max(1, hw.physical_cores))


def mfu_on(instance: Instance, precision: str, lora: bool) -> MfuChoice:
    return measured_mfu(precision, "amx" if instance.amx else "avx512", lora)


def step_on_instance(plan, global_batch: int, instance: Instance, ranks_per_node: int,
                     network: Network) -> tuple[StepTimePlan, MfuChoice]:
    """The step of memory plan `plan` on nodes of `instance`, `ranks_per_node` to a node."""
    settings = StepSettings.of_plan(plan, global_batch)
    choice = mfu_on(instance, settings.precision, plan.shape.lora)
    compute = measured_compute(rank_peak_flops(settings.precision, instance=instance, ranks_per_node=ranks_per_node),
                               choice, settings.strategy, settings.layout, IMAGE_ALLOCATOR, settings.precision)
    step = plan_step_time(settings, plan.inputs.world_size, ranks_per_node, plan.shape, compute,
                          network.link(network.link_of(instance)))
    return step, choice
