"""The plan of the run being started: plan.json in the run folder, and a warning when the
machine cannot hold it (before any weight exists, rather than an OOM kill an hour in)."""

from __future__ import annotations

import logging

from cputrain.plan.memory.build import plan_of_built
from cputrain.plan.model_shape import shape_of
from cputrain.plan.memory.report import plan_json

log = logging.getLogger("cputrain")
GIB = 2**30


def fused_copy_bytes(plan) -> int:
    """What the fused rollout decoder holds a rank where it could be left out: under fsdp, the whole
    model gathered in the compute dtype (cputrain.rollouts.fused_weight_size); 0 elsewhere (an
    unsharded rank's copy is its fused matrices only, and zero3 decodes through its modules)."""
    from cputrain.rollouts.fused_weight_size import fused_weight_bytes

    inp, shape = plan.inputs, plan.shape
    if not inp.rollout_rows or inp.strategy != "fsdp":
        return 0
    return fused_weight_bytes(shape.config_sizes, inp.precision, shape.blocks_held_dtype, lora=shape.lora, gathered=True)


def fused_rollout_fits(plan, local_world_size: int, machine_memory_gib: float) -> tuple[bool, str]:
    """(whether the rollouts decode fused, why not): an fsdp rank rolls out through its modules
    (a block gathered at a time) where the whole model's copy would take the node past its memory."""
    copy = fused_copy_bytes(plan)
    node_bytes = local_world_size * plan.peak_rank.total_bytes
    if not copy or node_bytes <= machine_memory_gib * GIB:
        return True, ""
    return False, (f"the fused decoder's copy of the whole model ({copy / GIB:.1f} GiB a rank) would take this node's "
                   f"{local_world_size} rank(s) to {node_bytes / GIB:.1f} GiB of {machine_memory_gib:.1f}")


def write_run_plan(run, cfg, skeleton, world_size: int, local_world_size: int, machine_memory_gib: float):
    """Plan from the model skeleton (exact shapes, the real vocabulary); returns the Plan."""
    plan = plan_of_built(cfg, world_size, shape_of(skeleton), ranks_per_node=local_world_size)
    run.write_text(plan_json(plan), "plan.json")
    node_gib = local_world_size * plan.peak_rank.total_bytes / GIB
    if not fused_rollout_fits(plan, local_world_size, machine_memory_gib)[0]:  # the rollouts leave the copy out
        node_gib -= local_world_size * fused_copy_bytes(plan) / GIB
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
    return plan
