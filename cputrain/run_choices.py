"""Every "auto" that needs more than the hardware, decided once per run, in one fixed order.

cputrain.resolve decides the machine's facts (precision, threads, compile, tokenizing processes,
strategy, backend). What is left needs the data, the model or the process group:

    1. data.format          from the first record's fields                     (data.sources)
    2. data.train_on        from the format                                    (data.example_kind)
    3. model.lora.target_modules   from the model's linear layers              (lora.adapters)
    4. model.lora.base_dtype       from the compute dtype and the weight files (lora.base_storage)
    5. model.attn_implementation   timed on rank 0 on the run's shape          (kernels.attention_choice)
    6. model.chunked_loss          from the precision and the head's size      (resolve)
    7. model.activation_checkpointing  from the plan on this node's memory     (plan.checkpointing)
    8. hardware.allocator          what this process was started with          (native.allocator)

Each rule lives with its domain and returns (value, why); this module only calls them and records
the answer, so the run's config.yaml holds every key's value with its reason, and nothing
downstream decides again. Every rank decides alike (the attention kernel is rank 0's, broadcast).
"""

from __future__ import annotations

import os

from cputrain.config.resolved import DecidedConfig
from cputrain.distributed.env import RankEnv
from cputrain.hardware import HardwareFacts
from cputrain.resolve import Resolution, chunked_loss_choice, with_model_choice


def with_data_choices(res: Resolution) -> Resolution:
    """data.format and data.train_on: what `prepare` and `eval` need, and the first two of a run's."""
    from cputrain.data.example_kind import train_on_choice
    from cputrain.data.sources import format_choice

    data = res.config.data
    if data.format == "auto":
        res = with_model_choice(res, "data.format", *format_choice(data))
    data = res.config.data
    if data.train_on == "auto":
        res = with_model_choice(res, "data.train_on", *train_on_choice(data.train_on, data.format))
    return res


def decide(res: Resolution, hw: HardwareFacts, ranks: RankEnv) -> Resolution:
    """Every key of the list above, in its order. Called by each rank once its process group exists."""
    res = with_data_choices(res)
    cfg = res.config
    needs_model = cfg.model.lora.enabled or "auto" in (cfg.model.chunked_loss, cfg.model.activation_checkpointing,
                                                      cfg.model.attn_implementation)
    source = None
    if needs_model:
        from cputrain import model as models

        # Every rank reads the model config, so a bad one stops all ranks alike. A model built from
        # scratch is sized with data.tokenizer_vocab_size before its tokenizer exists.
        source = models.resolve_source(cfg.model, vocab_size=cfg.model.tokenizer_vocab_size)
    if cfg.model.lora.enabled:
        res = _with_lora_choices(res, source)
    if res.config.model.attn_implementation == "auto":
        res = with_model_choice(res, "model.attn_implementation", *_attention(res.config, ranks, source.hf_config))
    now = res.config
    vocab = source.hf_config.vocab_size if source is not None else None
    if now.model.chunked_loss == "auto":  # by precision and the head's size: the same on every rank
        res = with_model_choice(res, "model.chunked_loss", *chunked_loss_choice(
            "auto", now.hardware.precision, now.train.micro_batch_size * now.data.seq_len, vocab))
    if now.model.activation_checkpointing == "auto":  # by the plan on this node's memory: same on every rank
        from cputrain.plan.checkpointing import checkpointing_choice

        res = with_model_choice(res, "model.activation_checkpointing", *checkpointing_choice(
            res.config, ranks.world_size, ranks.local_world_size, hw.memory_gib, vocab))
    if res.config.hardware.allocator == "auto":
        res = with_model_choice(res, "hardware.allocator", *_allocator(res.config.hardware.precision))
    # From here no key is "auto", by type: a rule that left one is a bug, named here.
    return Resolution(DecidedConfig.model_validate(res.config.model_dump()), res.reasons)


def _with_lora_choices(res: Resolution, source) -> Resolution:
    lora = res.config.model.lora
    if lora.target_modules == "auto":
        from cputrain import model as models
        from cputrain.lora.adapters import target_modules_choice

        skeleton = models.build_skeleton(source, res.config.model)  # on the meta device: no memory
        res = with_model_choice(res, "model.lora.target_modules", *target_modules_choice(skeleton, lora))
    if lora.base_dtype == "auto":
        from cputrain.lora.base_storage import base_dtype_choice, base_dtype_name, files_are_bf16

        bf16_files = source.folder is not None and files_are_bf16(source.folder)
        dtype, why = base_dtype_choice("auto", res.config.hardware.dtype, bf16_files)
        res = with_model_choice(res, "model.lora.base_dtype", base_dtype_name(dtype), why)
    return res


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


def _allocator(precision: str) -> tuple[str, str]:
    """What this process runs on: the allocator was preloaded before it started (or not)."""
    from cputrain.native.allocator import choose_allocator

    choice = choose_allocator("auto", precision=precision)
    loaded = choice.library is not None and choice.library in os.environ.get("LD_PRELOAD", "")
    if loaded or choice.library is None:
        return (choice.name if loaded else "system"), choice.reason
    return "system", (f"{choice.name} is installed but was not preloaded into this process (started by another "
                      "launcher): glibc malloc")
