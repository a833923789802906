"""Every "auto" that needs more than the hardware, decided once per run, in one fixed order.

cputrain.config.resolve decides the machine's facts (precision, threads, compile, tokenizing processes,
strategy, backend). What is left needs the data, the model or the process group:

    1. data.format          from the first record's fields                     (data.sources)
    2. data.train_on        from the format                                    (data.example_kind)
       data.shared_prompt   from the format; a resumed run's from its folder  (data.pairs)
    3. model.lora.target_modules   from the model's linear layers              (lora.adapters)
    4. model.lora.base_dtype       from the compute dtype and the weight files (lora.base_storage)
    5. model.attn_implementation   timed on rank 0 on the run's shape          (kernels.attention_choice)
    6. model.chunked_loss          from the precision and the head's size      (resolve)
    7. model.activation_checkpointing  from the plan on this node's memory     (plan.memory.checkpointing)
    8. hardware.allocator          what this process was started with          (native.allocator)

Each rule lives with its domain and returns (value, why); this module only calls them and records
the answer, so the run's config.yaml holds every key's value with its reason, and nothing
downstream decides again. Every rank decides alike (the attention kernel is rank 0's, broadcast).

`cputrain plan` and `cputrain k8s` walk the same list (decide_for_plan) before any run exists,
with a plan's facts instead of a running rank's: the precision and strategy as resolve decides
them for the planned instance, the model's config as the plan reads it (a built-in shape for a
known hub id, --model-config), no process group and no node yet. What a plan's facts cannot
decide as a run would is decided for the most memory a run may take, and says so: sdpa (a run
times both kernels and mostly keeps sdpa), every block checkpointed (a run checkpoints fewer
where its node holds more). The data's format and what is trained, and the allocator, are left to
the run: no byte of the plan depends on them, and a plan reads no data (its file may not be on
the planning machine).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from cputrain.config import Config
from cputrain.config.resolved import DecidedConfig, PlannedConfig
from cputrain.distributed.env import RankEnv
from cputrain.hardware import HardwareFacts
from cputrain.config.resolve import Resolution, chunked_loss_choice, resolve_for_plan, with_model_choice

if TYPE_CHECKING:
    from cputrain.plan.memory.build import Plan
    from cputrain.plan.instances import Instance

# A plan's answers where a run's need its node or its process group.
PLANNED_ATTENTION = ("sdpa", ("planned with sdpa's flash kernel, which keeps no attention matrix: a run times both "
                              "kernels on its shape (rank 0) and mostly takes sdpa; where it takes eager, its "
                              "plan.json counts each block's attention matrix"))
PLANNED_CHECKPOINTING = (True, ("planned with every block checkpointed (the least memory); a run checkpoints fewer "
                                "blocks where its node holds more, and writes its plan.json with them"))


def with_data_choices(res: Resolution) -> Resolution:
    """data.format, data.train_on and data.shared_prompt: what `prepare` and `eval` need, and the
    first of a run's; data.shared_prompt=true on data other than preference pairs is refused here."""
    from cputrain.data.example_kind import train_on_choice
    from cputrain.data.pairs import shared_prompt_choice
    from cputrain.data.sources import format_choice

    data = res.config.data
    if data.format == "auto":
        res = with_model_choice(res, "data.format", *format_choice(data))
    data = res.config.data
    if data.train_on == "auto":
        res = with_model_choice(res, "data.train_on", *train_on_choice(data.train_on, data.format))
    data = res.config.data
    shared, why = shared_prompt_choice(data.shared_prompt, data.format)
    if why:
        res = with_model_choice(res, "data.shared_prompt", *_resumed_layout(res.config, shared, why))
    return res


def _resumed_layout(cfg: Config, shared: bool, why: str) -> tuple[bool, str]:
    """data.shared_prompt=auto on a run folder with preference checkpoints: the layout the run
    started with, so its rows, and each step's pairs, stay those of a run never stopped; a folder
    written before the key existed laid its pairs out whole. Elsewhere auto's own choice."""
    from cputrain.run_folder.layout import RunFolder
    from cputrain.run_folder.run_config import recorded_config, recorded_identity

    recorded = recorded_config(RunFolder(cfg.output_dir))
    if recorded is None or recorded_identity(recorded, "data.format")[0] != "preference":
        return shared, why  # nothing to resume (another format is refused by the folder's check)
    value, held = recorded_identity(recorded, "data.shared_prompt")
    if not held:
        return False, ("this run folder's config.yaml was written before data.shared_prompt existed: its pairs "
                       "were laid out as two whole sequences, and the resumed run keeps them so")
    if value in (True, False):
        return value, "chosen when this run started (config.yaml)"
    return shared, why  # "auto" recorded: decided now, as the folder's check allows


def decide(res: Resolution, hw: HardwareFacts, ranks: RankEnv) -> Resolution:
    """Every key of the list above, in its order. Called by each rank once its process group exists."""
    res = _decide(res, _RunFacts(hw, ranks))
    # From here no key is "auto", by type: a rule that left one is a bug, named here.
    return Resolution(DecidedConfig.model_validate(res.config.model_dump()), res.reasons)


def decide_for_plan(cfg: Config, world_size: int, *, config_json: str | None = None,
                    vocab_size: int | None = None) -> Resolution:
    """The keys a plan reads, decided along the list above with a plan's facts, each with its
    reason. `config_json` and `vocab_size` as make_plan takes them (the model the plan is for)."""
    res = _decide(resolve_for_plan(cfg, world_size), _PlanFacts(config_json, vocab_size))
    # No key a plan reads is "auto" any more, by type.
    return Resolution(PlannedConfig.model_validate(res.config.model_dump()), res.reasons)


def decided_plan(cfg: Config, world_size: int, *, nproc_per_node: int | None = None,
                 instances: list[Instance] | None = None, config_json: str | None = None,
                 vocab_size: int | None = None) -> Plan:
    """The plan `cputrain plan` and `cputrain k8s` print and size pods by: `cfg`'s keys decided
    (decide_for_plan), then cputrain.plan.memory.build.make_plan, the decisions' reasons as its notes."""
    from cputrain.plan.memory.build import make_plan

    res = decide_for_plan(cfg, world_size, config_json=config_json, vocab_size=vocab_size)
    return make_plan(res.config, world_size, nproc_per_node=nproc_per_node, instances=instances,
                     config_json=config_json, vocab_size=vocab_size, reasons=res.reasons)


def _decide(res: Resolution, facts: _RunFacts | _PlanFacts) -> Resolution:
    """The list above, in its order, each rule asked with `facts` (a _RunFacts or a _PlanFacts)."""
    res = facts.data_choices(res)
    cfg = res.config
    source = None
    if cfg.model.lora.enabled or "auto" in (cfg.model.chunked_loss, cfg.model.activation_checkpointing,
                                            cfg.model.attn_implementation):
        source = facts.model_source(cfg)
    if cfg.model.lora.enabled:
        res = _with_lora_choices(res, source, facts)
    if res.config.model.attn_implementation == "auto":
        res = with_model_choice(res, "model.attn_implementation", *facts.attention(res.config, source.hf_config))
    now = res.config
    vocab = source.hf_config.vocab_size if source is not None else None
    if now.model.chunked_loss == "auto":  # by precision and the head's size: the same on every rank
        res = with_model_choice(res, "model.chunked_loss", *chunked_loss_choice(
            "auto", now.hardware.precision, now.train.micro_batch_size * now.data.seq_len, vocab))
    if res.config.model.activation_checkpointing == "auto":
        res = with_model_choice(res, "model.activation_checkpointing", *facts.checkpointing(res.config, vocab))
    if res.config.hardware.allocator == "auto":
        allocator = facts.allocator(res.config)
        if allocator is not None:
            res = with_model_choice(res, "hardware.allocator", *allocator)
    return res


def _with_lora_choices(res: Resolution, source, facts: _RunFacts | _PlanFacts) -> Resolution:
    lora = res.config.model.lora
    if lora.target_modules == "auto":
        from cputrain import model as models
        from cputrain.lora.adapters import target_modules_choice

        skeleton = models.build_skeleton(source, res.config.model)  # on the meta device: no memory
        res = with_model_choice(res, "model.lora.target_modules", *target_modules_choice(skeleton, lora))
    if lora.base_dtype == "auto":
        import torch

        from cputrain.lora.base_storage import base_dtype_choice, base_dtype_name

        compute = torch.bfloat16 if res.config.hardware.precision == "bf16" else torch.float32
        dtype, why = base_dtype_choice("auto", compute, facts.files_are_bf16(source, res.config))
        res = with_model_choice(res, "model.lora.base_dtype", base_dtype_name(dtype), why)
    return res


class _RunFacts:
    """A running rank's: its model folder, its node's memory, its process group and its process."""

    def __init__(self, hw: HardwareFacts, ranks: RankEnv):
        self.hw, self.ranks = hw, ranks

    def data_choices(self, res: Resolution) -> Resolution:
        return with_data_choices(res)

    def model_source(self, cfg):
        from cputrain import model as models

        # Every rank reads the model config, so a bad one stops all ranks alike. A model built from
        # scratch is sized with data.tokenizer_vocab_size before its tokenizer exists.
        return models.resolve_source(cfg.model, vocab_size=cfg.model.tokenizer_vocab_size)

    def files_are_bf16(self, source, cfg) -> bool:
        from cputrain.lora.base_storage import files_are_bf16

        return source.folder is not None and files_are_bf16(source.folder)

    def attention(self, cfg, hf_config) -> tuple[str, str]:
        return _attention(cfg, self.ranks, hf_config)

    def checkpointing(self, cfg, vocab: int | None) -> tuple[bool | int, str]:
        """By the plan on this node's memory: the same on every rank."""
        from cputrain.plan.memory.checkpointing import checkpointing_choice

        return checkpointing_choice(cfg, self.ranks.world_size, self.ranks.local_world_size, self.hw.memory_gib, vocab)

    def allocator(self, cfg) -> tuple[str, str]:
        return _allocator(cfg.hardware.precision, cfg.parallel.strategy)


class _PlanFacts:
    """A plan's: the model as the plan reads it (nothing fetched for a known hub id), no node yet."""

    def __init__(self, config_json: str | None, vocab_size: int | None):
        self.config_json, self.vocab_size = config_json, vocab_size

    def data_choices(self, res: Resolution) -> Resolution:
        return res  # left to the run: no byte of the plan depends on them, and a plan reads no data

    def model_source(self, cfg):
        from cputrain import model as models
        from cputrain.plan.model_shape import hf_config_for, model_folder

        folder = model_folder(cfg.model.name_or_path) if cfg.model.name_or_path else None
        return models.ModelSource(folder, hf_config_for(cfg.model, self.vocab_size, self.config_json))

    def files_are_bf16(self, source, cfg) -> bool:
        """Read from the files' headers where they are on this machine; a known hub id that is not
        is planned as published, in bf16."""
        from cputrain.lora.base_storage import files_are_bf16
        from cputrain.plan.model_shape import known_hub_config

        if source.folder is not None and any(source.folder.glob("*.safetensors")):
            return files_are_bf16(source.folder)
        return known_hub_config(cfg.model.name_or_path) is not None

    def attention(self, cfg, hf_config) -> tuple[str, str]:
        return PLANNED_ATTENTION

    def checkpointing(self, cfg, vocab: int | None) -> tuple[bool | int, str]:
        return PLANNED_CHECKPOINTING

    def allocator(self, cfg) -> None:
        return None  # the run's process decides it; the plan does not count the allocator


def _attention(cfg, ranks: RankEnv, hf_config) -> tuple[str, str]:
    """model.attn_implementation=auto: rank 0 times both kernels on the model's attention shape and
    every rank takes its choice; a resumed run keeps the kernel it started with."""
    from cputrain.distributed import process_group as pg
    from cputrain.kernels.attention_choice import choose_attention
    from cputrain.run_folder.layout import RunFolder
    from cputrain.run_folder.run_config import recorded_value

    # Timing again could pick the other kernel, and the losses after the resume would no longer
    # be those of a run never stopped.
    resumed_with = recorded_value(RunFolder(cfg.output_dir), "model.attn_implementation")
    if resumed_with in ("sdpa", "eager"):
        return resumed_with, "chosen when this run started (config.yaml)"
    mine = choose_attention(hf_config, cfg.train.micro_batch_size, cfg.data.seq_len, cfg.hardware.dtype) \
        if ranks.is_main else None
    choice = pg.broadcast_from_main(mine)
    return choice.implementation, choice.reason


def _allocator(precision: str, strategy: str) -> tuple[str, str]:
    """What this process runs on: the allocator was preloaded before it started (or not), or glibc
    tuned by the worker before the model is built."""
    from cputrain.native.allocator import choose_allocator

    choice = choose_allocator("auto", precision=precision, strategy=strategy)
    loaded = choice.library is not None and choice.library in os.environ.get("LD_PRELOAD", "")
    if loaded or choice.library is None:
        return (choice.name if loaded or choice.name == "glibc-tuned" else "system"), choice.reason
    return "system", (f"{choice.name} is installed but was not preloaded into this process (started by another "
                      "launcher): glibc malloc")

