"""The config after cputrain.config.resolve: the same keys and dump, every "auto" a value, and read-only,
so code downstream takes a thread count as an int and a precision as a torch dtype without
casting, and nothing in a run can change a value that other parts of it have already read."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from cputrain.config.sections import (Config, MixedCheckpointing, DataConfig, HardwareConfig, LaunchConfig, LoraConfig, ModelConfig,
                                      ParallelConfig, TrainConfig)

# Read-only: after resolution nothing in a run may change the config (a value changed in the middle
# of setup would be seen by some parts of the run and not by others).
_READ_ONLY = ConfigDict(frozen=True)


class ResolvedHardwareConfig(HardwareConfig):
    model_config = _READ_ONLY
    precision: Literal["fp32", "bf16"]
    threads: int = Field(gt=0)

    @property
    def dtype(self):
        """The compute dtype: torch.bfloat16 or torch.float32."""
        import torch

        return torch.bfloat16 if self.precision == "bf16" else torch.float32


class ResolvedLoraConfig(LoraConfig):
    model_config = _READ_ONLY


class ResolvedModelConfig(ModelConfig):
    model_config = _READ_ONLY
    compile: bool
    lora: ResolvedLoraConfig
    # attn_implementation, chunked_loss, activation_checkpointing, the LoRA targets and base dtype
    # may still be "auto" here: they need the data, the model's shape or the process group, and
    # cputrain.training.choices decides them before a model is built.


class ResolvedDataConfig(DataConfig):
    model_config = _READ_ONLY
    num_proc: int = Field(gt=0)


class ResolvedTrainConfig(TrainConfig):
    model_config = _READ_ONLY


class ResolvedParallelConfig(ParallelConfig):
    model_config = _READ_ONLY
    strategy: Literal["single", "ddp", "fsdp", "zero3"]
    backend: Literal["gloo", "ccl"]


class ResolvedLaunchConfig(LaunchConfig):
    model_config = _READ_ONLY


class ResolvedConfig(Config):
    """A Config after cputrain.config.resolve: the same keys and dump, every "auto" a value, read-only."""

    model_config = _READ_ONLY
    model: ResolvedModelConfig
    data: ResolvedDataConfig
    train: ResolvedTrainConfig
    hardware: ResolvedHardwareConfig
    parallel: ResolvedParallelConfig
    launch: ResolvedLaunchConfig


# After cputrain.training.choices: the keys that need the data, the model or the process group are
# decided too, so a run's config admits no "auto" at all, by type. LoRA's two keys are decided
# only where LoRA is on (they mean nothing otherwise).
class DecidedLoraConfig(ResolvedLoraConfig):
    @model_validator(mode="after")
    def _decided_where_enabled(self):
        if self.enabled and "auto" in (self.target_modules, self.base_dtype):
            raise ValueError("model.lora.target_modules and model.lora.base_dtype must be decided for a LoRA run")
        return self


class DecidedModelConfig(ResolvedModelConfig):
    attn_implementation: Literal["sdpa", "eager"]
    chunked_loss: bool
    activation_checkpointing: bool | int | Literal["selective"] | MixedCheckpointing
    lora: DecidedLoraConfig


class DecidedDataConfig(ResolvedDataConfig):
    format: Literal["text", "chat", "prompt_completion", "alpaca", "preference", "feedback", "prompt"]
    train_on: Literal["assistant", "completion", "all"]
    shared_prompt: bool


class DecidedHardwareConfig(ResolvedHardwareConfig):
    allocator: Literal["tcmalloc", "jemalloc", "glibc-tuned", "system"]


def _fsdp_keys_decided(parallel):
    """fsdp's layout and reduce dtype are decided where the strategy is fsdp (they mean nothing
    otherwise, and sections.ParallelConfig refuses them there)."""
    if parallel.strategy == "fsdp" and "auto" in (parallel.layout, parallel.reduce_dtype):
        raise ValueError("parallel.layout and parallel.reduce_dtype must be decided for an fsdp run")
    return parallel


class DecidedParallelConfig(ResolvedParallelConfig):
    @model_validator(mode="after")
    def _decided_where_fsdp(self):
        return _fsdp_keys_decided(self)


class DecidedConfig(ResolvedConfig):
    """A run's config once every "auto" is decided (cputrain.training.choices): what the Trainer gets."""

    model: DecidedModelConfig
    data: DecidedDataConfig
    hardware: DecidedHardwareConfig
    parallel: DecidedParallelConfig


# What a plan reads: the keys that change a rank's bytes, decided. cputrain.training.choices decides
# them for `cputrain plan` and `cputrain k8s` with a plan's facts (decide_for_plan), and for a run
# with its node's (decide): a run's DecidedConfig is a planned config too. Threads, tokenizing
# processes, compile, the backend, the allocator and the data's format may still be "auto" here:
# no byte of the plan depends on them. LoRA's keys count where LoRA is on, fsdp's where the
# strategy is fsdp.
PLANNED_KEYS = ("hardware.precision", "parallel.strategy", "parallel.layout", "parallel.reduce_dtype",
                "model.attn_implementation", "model.chunked_loss", "model.activation_checkpointing",
                "model.lora.target_modules", "model.lora.base_dtype")


class PlannedHardwareConfig(HardwareConfig):
    model_config = _READ_ONLY
    precision: Literal["fp32", "bf16"]


class PlannedParallelConfig(ParallelConfig):
    model_config = _READ_ONLY
    strategy: Literal["single", "ddp", "fsdp", "zero3"]

    @model_validator(mode="after")
    def _decided_where_fsdp(self):
        return _fsdp_keys_decided(self)


class PlannedModelConfig(ModelConfig):
    model_config = _READ_ONLY
    attn_implementation: Literal["sdpa", "eager"]
    chunked_loss: bool
    activation_checkpointing: bool | int | Literal["selective"] | MixedCheckpointing
    lora: DecidedLoraConfig


class PlannedConfig(Config):
    """A config as `make_plan` takes it: every key of PLANNED_KEYS decided, read-only."""

    model_config = _READ_ONLY
    model: PlannedModelConfig
    hardware: PlannedHardwareConfig
    parallel: PlannedParallelConfig


def undecided_for_plan(cfg: Config) -> list[str]:
    """The keys of PLANNED_KEYS still "auto" in `cfg` (LoRA's only where LoRA is on, fsdp's only
    under fsdp)."""
    def value(key: str):
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        return node

    def counts(key: str) -> bool:
        if key.startswith("model.lora."):
            return cfg.model.lora.enabled
        if key in ("parallel.layout", "parallel.reduce_dtype"):
            return cfg.parallel.strategy == "fsdp"
        return True

    return [key for key in PLANNED_KEYS if value(key) == "auto" and counts(key)]


def as_planned(cfg: Config) -> PlannedConfig:
    """`cfg` as a plan reads it. A key still "auto" is named, not decided here: the plan would
    then hold a second rule beside cputrain.training.choices', and drift from what a run does."""
    if isinstance(cfg, PlannedConfig):
        return cfg
    left = undecided_for_plan(cfg)
    if left:
        raise ValueError(f"a plan reads decided values (cputrain.training.choices.decide_for_plan decides them); "
                         f"still auto: {', '.join(left)}")
    return PlannedConfig.model_validate(cfg.model_dump())
