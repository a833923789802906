"""The plan of the run being started: plan.json in the run folder, and a warning when the
machine cannot hold it (before any weight exists, rather than an OOM kill an hour in)."""

from __future__ import annotations

import logging

from cputrain.plan.memory.build import plan_of_built
from cputrain.plan.memory.estimate import fused_decoder_bytes
from cputrain.plan.model_shape import shape_of
from cputrain.plan.memory.report import plan_json

log = logging.getLogger("cputrain")
GIB = 2**30


def fused_rollout_fits(plan, local_world_size: int, machine_memory_gib: float) -> tuple[bool, str]:
    """(whether the rollouts decode fused, why not): an fsdp rank rolls out through its modules
    (a block gathered at a time) where the whole model's copy would take the node past its memory.
    An unsharded rank's copy is its fused matrices only, and is always kept."""
    copy = fused_decoder_bytes(plan.shape, plan.inputs) if plan.inputs.strategy == "fsdp" else 0
    node_bytes = local_world_size * plan.peak_rank.total_bytes
    if not copy or node_bytes <= machine_memory_gib * GIB:
        return True, ""
    return False, (f"the fused decoder's copy of the whole model ({copy / GIB:.1f} GiB a rank) would take this node's "
                   f"{local_world_size} rank(s) to {node_bytes / GIB:.1f} GiB of {machine_memory_gib:.1f}")


def write_run_plan(run, cfg, skeleton, world_size: int, local_world_size: int,
                   machine_memory_gib: float) -> tuple:
    """Plan from the model skeleton (exact shapes, the real vocabulary); returns (the Plan, whether
    online RL's rollouts decode fused: fused_rollout_fits)."""
    plan = plan_of_built(cfg, world_size, shape_of(skeleton), ranks_per_node=local_world_size)
    run.write_text(plan_json(plan), "plan.json")
    node_gib = local_world_size * plan.peak_rank.total_bytes / GIB
    fused, why = fused_rollout_fits(plan, local_world_size, machine_memory_gib)
    if not fused:  # the rollouts leave the copy out
        log.info("rollouts: through the model's modules, a block gathered at a time: %s", why)
        node_gib -= local_world_size * fused_decoder_bytes(plan.shape, plan.inputs) / GIB
    if node_gib > machine_memory_gib:
        log.warning(
            "memory plan: %d rank(s) on this node need about %.1f GiB but the machine has %.1f GiB; expect the run "
            "to be killed for memory. Shard with parallel.strategy=fsdp, turn on model.activation_checkpointing, "
            "lower train.micro_batch_size, or use more nodes (`cputrain plan` shows what fits)",
            local_world_size, node_gib, machine_memory_gib,
        )
    else:
        log.info("memory plan: %.2f GiB per rank, %.1f GiB for this node's %d rank(s) of %.1f GiB (plan.json)",
                 plan.peak_rank.total_bytes / GIB, node_gib, local_world_size, machine_memory_gib)
    return plan, fused
