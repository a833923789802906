"""What a checkpoint is worth, said before the run: the time between two saves at the planned
step, and the work a lost node costs at that rate.

A node lost without notice (a spot reclaim whose two minutes do not cover a step and a save, a
kernel panic, a cut link) stops every rank of the group: the run resumes from the newest complete
checkpoint, so the work since it is done again on every node, not only the lost one's. At most
that is the interval between saves:

    interval   = min(train.checkpoint_every × step, train.checkpoint_every_s)
    lost work  = interval × nodes   (node-hours, and their price on the plan's instance)
    save share = one save ÷ (interval + one save): what the saves themselves take of the run

`cputrain plan` prints it after the time plan; a run logs it among its first lines, from its own
node's planned step. `train.checkpoint_every_s` bounds the interval in seconds; it is not set
automatically: a run cannot tell that it is on spot capacity (the rendered NodePools ask for
on-demand nodes), and the interval worth choosing depends on how often the user's nodes fail,
which no plan knows — the figures here are what that choice is made from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointWorth:
    step_s: float  # the planned (or measured) optimizer step
    every_steps: int  # train.checkpoint_every
    every_s: float | None  # train.checkpoint_every_s
    save_s: float  # one save: the checkpoint's bytes at the storage's write rate
    nnodes: int
    node_price_per_hour: float | None = None  # USD, the plan's instance (None: no price said)

    @property
    def interval_s(self) -> float:
        by_steps = self.every_steps * self.step_s
        return min(by_steps, self.every_s) if self.every_s else by_steps

    @property
    def lost_node_hours(self) -> float:
        return self.interval_s * self.nnodes / 3600

    @property
    def lost_usd(self) -> float | None:
        return None if self.node_price_per_hour is None else self.lost_node_hours * self.node_price_per_hour

    @property
    def save_share(self) -> float:
        return self.save_s / (self.interval_s + self.save_s) if self.interval_s + self.save_s > 0 else 0.0

    def line(self) -> str:
        by = (f"train.checkpoint_every={self.every_steps} steps"
              + (f" or train.checkpoint_every_s={self.every_s:g}, whichever comes first" if self.every_s else ""))
        cost = f", {self.lost_usd:,.2f} USD" if self.lost_usd is not None else ""
        return (f"a save every {duration(self.interval_s)} ({by}, at {duration(self.step_s)} a step); a node lost "
                f"costs up to that on every node: {self.lost_node_hours:,.1f} node-hours{cost}; each save "
                f"~{duration(self.save_s)}, {self.save_share:.1%} of the run"
                + ("" if self.every_s else "; train.checkpoint_every_s bounds the interval in seconds"))

    def as_dict(self) -> dict:
        return {"interval_s": self.interval_s, "lost_node_hours": self.lost_node_hours, "lost_usd": self.lost_usd,
                "save_s": self.save_s, "save_share": self.save_share}


def duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "never"
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds:,.1f} s" if seconds >= 1 else f"{seconds * 1e3:,.0f} ms"


def save_seconds(shape, strategy: str, precision: str, storage_write_mib_s: float | None = None) -> float:
    """One save: the checkpoint's bytes over the storage's write rate (cputrain.plan.time.stop_window's)."""
    from cputrain.plan.time.stop_window import DEFAULT_STORAGE_WRITE_MIB_S, checkpoint_bytes

    rate = storage_write_mib_s or DEFAULT_STORAGE_WRITE_MIB_S
    return checkpoint_bytes(shape, strategy, precision) / (rate * 2**20)


def worth_of_plan(step, plan, train, price_per_hour: float | None) -> CheckpointWorth:
    """`cputrain plan`'s figure: `step` is its StepTimePlan on the plan's instance."""
    return CheckpointWorth(step.step_s, train.checkpoint_every, train.checkpoint_every_s,
                           save_seconds(plan.shape, plan.inputs.strategy, plan.inputs.precision), step.nnodes,
                           price_per_hour)


def worth_here(plan, cfg, hw, world_size: int, ranks_per_node: int) -> CheckpointWorth:
    """A run's figure, from its own node: the rank's share of this machine's peak at the MFU measured
    for its CPU (cputrain.plan.time.measured_mfu), the network as parallel.layout=auto plans a run's."""
    from cputrain.plan.time.measured_mfu import cpu_kind, measured_mfu
    from cputrain.plan.time.on_instance import RUN_NETWORK, rank_peak_flops
    from cputrain.plan.time.sharded_compute import measured_compute, running_allocator
    from cputrain.plan.time.step_time import StepSettings, plan_step_time

    precision = cfg.hardware.precision
    mfu = measured_mfu(precision, cpu_kind(hw.flags), cfg.model.lora.enabled)
    compute = measured_compute(rank_peak_flops(precision, hw=hw, threads=cfg.hardware.threads), mfu,
                               cfg.parallel.strategy, cfg.parallel.layout, running_allocator(cfg), precision)
    nnodes = max(1, world_size // max(1, ranks_per_node))
    link = RUN_NETWORK.link(RUN_NETWORK.link_gbit_s if nnodes > 1 else None)
    step = plan_step_time(StepSettings.of_plan(plan, cfg.train.global_batch_size), world_size, ranks_per_node,
                          plan.shape, compute, link)
    return CheckpointWorth(step.step_s, cfg.train.checkpoint_every, cfg.train.checkpoint_every_s,
                           save_seconds(plan.shape, plan.inputs.strategy, precision), nnodes)
