"""How long a run needs to stop cleanly after a SIGTERM: finish the step it is in, then write a
checkpoint. `cputrain k8s` sets the pods' terminationGracePeriodSeconds and the agent's
launch.stop_timeout_s from it, so a node drain never kills a save half-way (the kubelet's
default grace period is 30 s; one step of an 8B model is minutes).

    stop window = one step (cputrain.plan.time.step_time's compute, no network) at an assumed
                  fraction of the instance's peak FLOP/s
                + the whole checkpoint's bytes at the storage's write rate
    grace period = stop window + a margin for the agent's own exit

Every rank writes its shards at once to the same shared file system (FSx for Lustre: its
throughput is the file system's, shared by all clients), so a save takes the checkpoint's total
bytes over that rate, whatever the number of ranks. Both assumptions are stated so a user can
correct them: `--storage-write-mib-s`, or `--grace-period-s` to set the period outright.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cputrain.plan.instances import Instance
from cputrain.plan.memory.accounting import BYTES_PER_PARAM
from cputrain.plan.model_shape import ModelShape
from cputrain.plan.time.on_instance import rank_peak_flops
from cputrain.plan.time.step_time import Compute, StepSettings, plan_step_time

# FSx for Lustre's smallest file system (1.2 TiB, SCRATCH_2) has a baseline of 200 MB/s per TiB,
# 240 MB/s; 200 MiB/s stays below it. Other storage: pass its rate.
DEFAULT_STORAGE_WRITE_MIB_S = 200.0
# A step's share of the theoretical peak, on the low side on purpose: a step estimated too long
# only keeps a pod a little longer, one estimated too short kills the save it waited for.
# (AMX bf16 steps measure 20-40% of the tile peak; fp32 steps ~40% of the FMA peak.)
ASSUMED_MFU = 0.10
# The agent's exit after its ranks have saved: closing the rendezvous, the last log lines.
EXIT_MARGIN_S = 30
# A spot instance gets two minutes' notice before it is reclaimed, whatever the grace period.
SPOT_NOTICE_S = 120


@dataclass(frozen=True)
class StopWindow:
    step_s: float
    checkpoint_bytes: int
    save_s: float
    storage_write_mib_s: float

    @property
    def stop_timeout_s(self) -> int:
        """What the agent gives its ranks after forwarding the signal (launch.stop_timeout_s)."""
        return max(1, math.ceil(self.step_s + self.save_s))

    @property
    def grace_period_s(self) -> int:
        return self.stop_timeout_s + EXIT_MARGIN_S

    def describe(self) -> str:
        return (f"stop window {self.stop_timeout_s} s: one step ~{self.step_s:,.0f} s (at {ASSUMED_MFU:.0%} of the "
                f"instance's peak) + a {self.checkpoint_bytes / 2**30:,.1f} GiB checkpoint at "
                f"{self.storage_write_mib_s:g} MiB/s ~{self.save_s:,.0f} s, then {EXIT_MARGIN_S} s for the agent's exit")


def checkpoint_bytes(shape: ModelShape, strategy: str, precision: str) -> int:
    """Bytes of one checkpoint across all ranks: each trained parameter as stored plus its optimizer
    state (frozen weights are never saved; DCP writes a replicated tensor once)."""
    p_bytes, _, k_bytes = BYTES_PER_PARAM[(strategy, precision)]
    return shape.trainable_params * (p_bytes + k_bytes)


def stop_window(plan, global_batch: int, instance: Instance, nnodes: int,
                storage_write_mib_s: float = DEFAULT_STORAGE_WRITE_MIB_S) -> StopWindow:
    """The stop window of memory plan `plan` (cputrain.plan.memory.build.Plan) on `nnodes` nodes of `instance`."""
    ranks_per_node = plan.inputs.world_size // nnodes
    settings = StepSettings.of_plan(plan, global_batch)
    compute = Compute(rank_peak_flops(settings.precision, instance=instance, ranks_per_node=ranks_per_node),
                      ASSUMED_MFU, "assumed")
    step_s = plan_step_time(settings, plan.inputs.world_size, ranks_per_node, plan.shape, compute).compute_s
    ckpt = checkpoint_bytes(plan.shape, settings.strategy, settings.precision)
    return StopWindow(step_s=step_s, checkpoint_bytes=ckpt, save_s=ckpt / (storage_write_mib_s * 2**20),
                      storage_write_mib_s=storage_write_mib_s)
