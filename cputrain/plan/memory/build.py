"""From a run config to a whole plan: model shape → per-rank bytes → the smallest cluster."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cputrain.config import Config
from cputrain.config.reduction import reduce_scatter_in_use
from cputrain.config.resolve import grad_accum_steps
from cputrain.config.resolved import PlannedConfig, as_planned
from cputrain.errors import ConfigError
from cputrain.objectives.objective import objective_class
from cputrain.parallel.fsdp_layouts import DEFAULT_LAYOUT, layout_error
from cputrain.plan.memory.estimate import PlanInputs, RankPlan, plan_all_ranks, plan_inputs
from cputrain.plan.memory.fit import ClusterFit, smallest_cluster
from cputrain.plan.instances import Instance
from cputrain.plan.model_shape import ModelShape, known_hub_config, model_shape, with_weight_files


@dataclass
class Plan:
    shape: ModelShape
    inputs: PlanInputs
    ranks: list[RankPlan]
    fit: ClusterFit | None  # None when no instance table was asked for (inside a running job)
    notes: list[str]

    @property
    def peak_rank(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.total_bytes)



def rollout_inputs(cfg, world_size: int) -> dict:
    """Online RL's rollout as the plans count it: this rank's completions a step, each row up to
    data.seq_len positions (a prompt leaves train.max_completion_length of it); none otherwise."""
    if not objective_class(cfg.train.objective).batches_from_rollouts:
        return {}
    return {"rollout_rows": cfg.train.global_batch_size // world_size, "rollout_len": cfg.data.seq_len}

# data.format values whose rows, packed, hold several examples at restarting positions
PACKED_EXAMPLE_FORMATS = ("chat", "prompt_completion", "alpaca")
# and those whose rows always do: a pair (data.preference.rows), or a sequence and its padding (data.feedback.rows)
SEQUENCES_A_ROW_FORMATS = ("preference", "feedback")


def carries_attention_mask(cfg) -> bool:
    """Whether a micro-batch carries a 4D mask: rows of several sequences (from their positions,
    cputrain.data.batch.packed_mask, or a shared prompt's, data.preference.rows), or online RL's
    rows, where a group's completions may share its prompt."""
    if objective_class(cfg.train.objective).batches_from_rollouts:
        return True
    return cfg.data.format in SEQUENCES_A_ROW_FORMATS or (cfg.data.format in PACKED_EXAMPLE_FORMATS
                                                           and cfg.data.packing)


def _zero3_settings(cfg: Config, world_size: int, shape: ModelShape) -> dict:
    """From the DeepSpeed config the zero3 strategy will run with (generated or the user's file)."""
    if cfg.parallel.strategy != "zero3":
        return {}
    from cputrain.parallel.deepspeed_config import plan_for

    zero = plan_for(cfg, world_size, grad_accum_steps(cfg, world_size), shape.hidden).config["zero_optimization"]
    return {"persistence_threshold": int(zero["stage3_param_persistence_threshold"]),
            "max_reuse_distance": int(zero.get("stage3_max_reuse_distance", 10**9))}


def make_plan(cfg: Config, world_size: int, *, nproc_per_node: int | None = None,
              instances: list[Instance] | None = None, config_json: str | None = None,
              vocab_size: int | None = None, shape: ModelShape | None = None,
              reasons: Sequence[tuple[str, str, str]] = ()) -> Plan:
    """The plan of `cfg` with its keys decided (config.resolved.PLANNED_KEYS: by
    cputrain.training.choices.decide_for_plan before a run, by decide in one); a key still "auto" is
    refused, not decided here. `reasons`: the decisions' (key, value, why), the plan's notes.
    `shape`: the model as built (the trainer's skeleton, adapters and dtypes included); without it
    the model is built from the config, with model.lora's adapters added the same way."""
    cfg = _planned(cfg, world_size)
    if shape is None:
        import torch

        compute_dtype = torch.bfloat16 if cfg.hardware.precision == "bf16" else torch.float32
        shape = model_shape(cfg.model, vocab_size=vocab_size, config_json=config_json, compute_dtype=compute_dtype,
                            seed=cfg.seed, head=objective_class(cfg.train.objective).head)
    return _plan(cfg, world_size, shape, nproc_per_node, instances, config_json, reasons, nproc_per_node)


def plan_of_built(cfg: Config, world_size: int, shape: ModelShape, ranks_per_node: int | None = None) -> Plan:
    """The plan of a running rank's model, as built (the trainer's skeleton: adapters and dtypes
    included), for its plan.json: nothing is built here. `ranks_per_node`: the node's ranks (the
    layouts that keep a node's share read it)."""
    return _plan(_planned(cfg, world_size), world_size, shape, None, None, None, (), ranks_per_node)


def _planned(cfg: Config, world_size: int) -> PlannedConfig:
    from cputrain.config import batch_error

    cfg = as_planned(cfg)
    error = batch_error(cfg.train, world_size)  # the rule `train` applies: a plan it would refuse is no plan
    if error:
        raise ConfigError(error)
    return cfg


def _plan(cfg: PlannedConfig, world_size: int, shape: ModelShape, nproc_per_node: int | None,
          instances: list[Instance] | None, config_json: str | None, reasons: Sequence[tuple[str, str, str]],
          ranks_per_node: int | None) -> Plan:
    shape = with_weight_files(shape, cfg.model)  # what loading reads, and in which dtype
    parallel = cfg.parallel
    fsdp = parallel.strategy == "fsdp"
    # What the strategies take from below the plan, read before the inputs are put together:
    # DeepSpeed's own thresholds (zero3) and the reduce-scatter the backend runs.
    zero3 = _zero3_settings(cfg, world_size, shape)
    reduce_scatter = reduce_scatter_in_use(parallel.reduce_scatter, parallel.backend)
    inputs = plan_inputs(
        cfg.parallel.strategy, cfg.hardware.precision, world_size,
        micro_batch=cfg.train.micro_batch_size, seq_len=cfg.data.seq_len,
        activation_checkpointing=cfg.model.activation_checkpointing,
        offload_optimizer=cfg.parallel.offload_optimizer, offload_param=cfg.parallel.offload_param,
        from_scratch=cfg.model.name_or_path is None,
        lora_dropout=cfg.model.lora.dropout if cfg.model.lora.enabled else 0.0,
        chunked_loss=cfg.model.chunked_loss,
        eager_attention=cfg.model.attn_implementation == "eager",
        layout=parallel.layout if fsdp else DEFAULT_LAYOUT, reduce_dtype=parallel.reduce_dtype if fsdp else None,
        reduce_scatter=reduce_scatter,
        prefetch=parallel.strategy == "fsdp" and parallel.prefetch,
        overlap_reduction=fsdp and parallel.overlap_reduction,
        ranks_per_node=ranks_per_node, accumulation=grad_accum_steps(cfg, world_size),
        extra_forwards=objective_class(cfg.train.objective).extra_forwards,
        attention_mask=carries_attention_mask(cfg),
        **rollout_inputs(cfg, world_size),
        **zero3,
    )
    if fsdp and ranks_per_node:
        error = layout_error(parallel.layout, world_size, ranks_per_node)
        if error:
            raise ConfigError(error)
    notes = [f"{key}=auto → {value}: {why}" for key, value, why in reasons]
    if config_json is None and known_hub_config(cfg.model.name_or_path) is not None:
        notes.append(f"{cfg.model.name_or_path}: its shape is built in (nothing fetched); --model-config "
                     "plans another config.json")
    if inputs.offload_optimizer or inputs.offload_param:
        notes.append("offload moves state to host memory, which on a CPU node is the same RAM: "
                     "it does not lower the per-rank total")
    ranks = plan_all_ranks(shape, inputs)
    fit = None
    if instances is not None:
        fit = smallest_cluster(instances, max(r.total_bytes for r in ranks), world_size, nproc_per_node)
    return Plan(shape, inputs, ranks, fit, notes)
