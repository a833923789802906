"""LoRA as a model converter: peft's adapters into the skeleton, filled after the strategy has
materialized it, a checkpoint of the adapters alone, a peft adapter folder as the export, and
the base weights' fingerprint recorded and checked (cputrain.lora.base_model)."""

from __future__ import annotations

import contextlib
import logging

from torch import nn

from cputrain.config.resolved import ResolvedConfig
from cputrain.lora import base_model
from cputrain.lora.base_storage import BASE_DTYPES
from cputrain.lora.adapters import ADAPTER, add_adapters, base_file_name, fill_adapters, is_exported_parameter
from cputrain.model.converter import ModelConverter

log = logging.getLogger("cputrain")


def converter_for(cfg: ResolvedConfig, is_main: bool) -> ModelConverter:
    """The run's converter: LoRA's where model.lora is enabled, else the identity (full fine-tuning)."""
    return LoraConverter(cfg, is_main) if cfg.model.lora.enabled else ModelConverter(cfg.seed)


class LoraConverter(ModelConverter):
    name = "lora"

    def __init__(self, cfg: ResolvedConfig, is_main: bool):
        super().__init__(cfg.seed)
        self.cfg, self.is_main = cfg, is_main
        self.initial: dict = {}  # adapter name -> initial full tensor, from convert() until fill()

    def check_run_folder(self, run) -> None:
        base_model.check_same_base(run, self.cfg.model.name_or_path)

    def convert(self, skeleton: nn.Module, source) -> None:
        """Adapters into the skeleton, the rest frozen (bf16 where the compute is); their initial
        values are kept until the strategy has materialized the model."""
        cfg = self.cfg
        super().convert(skeleton, source)  # a reward model's head the files lack: filled with the adapters
        # Decided before the run (cputrain.training.choices, with its reason in config.yaml): read, not decided again.
        base_dtype = BASE_DTYPES[cfg.model.lora.base_dtype]
        self.initial = add_adapters(skeleton, cfg.model.lora, frozen_dtype=base_dtype, seed=cfg.seed,
                                    base_path=str(source.folder.resolve()), compute_dtype=cfg.hardware.dtype)
        if self.is_main:
            trained = sum(t.numel() for t in self.initial.values())
            total = sum(p.numel() for p in skeleton.parameters())
            log.info("model.lora: rank %d on %s: %s trained parameters (%.2f%% of %s); the base is frozen in %s (model.lora.base_dtype; why: config.yaml)",
                     cfg.model.lora.rank, ", ".join(sorted(skeleton.peft_config[ADAPTER].target_modules)),
                     f"{trained:,}", 100 * trained / total, f"{total:,}", str(base_dtype).removeprefix("torch."))

    def file_name_of(self, param_name: str) -> str | None:
        if super().file_name_of(param_name) is None:  # a new score head
            return None
        return base_file_name(param_name)  # adapters are in no file: fill() gives them their values

    def fill(self, model: nn.Module) -> None:
        super().fill(model)
        fill_adapters(model, self.initial)
        self.initial = {}

    def record(self, run, source) -> None:
        base_model.record(run, source.folder)

    @contextlib.contextmanager
    def reference(self, model: nn.Module):
        """The base model, for DPO's reference: every peft layer computes without its adapter
        (peft's enable_adapters(False)) until the context ends, then with it again."""
        from cputrain.lora.adapters import lora_layers

        layers = [layer for _, layer in lora_layers(model)]
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield model
        finally:
            for layer in layers:
                # enable_adapters(True) makes the adapters trainable again: peft's own switch
                layer.enable_adapters(True)

    def export(self, strategy, model: nn.Module, hf_config, tokenizer, target: str, is_writer: bool) -> None:
        """model/ is a peft adapter folder: the adapters alone (and a reward model's head), gathered
        from every rank."""
        from cputrain.lora.adapter_folder import write_adapter_folder

        write_adapter_folder(strategy.full_state_dict(model, keep=is_exported_parameter), strategy.unwrap(model),
                             tokenizer, target, is_writer=is_writer)
