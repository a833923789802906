"""Adding LoRA adapters to the model skeleton, before any strategy wraps it.

peft's `inject_adapter_in_model` puts its LoRA layers into the Hugging Face model in place: the
model keeps its class and its module names (so decoder_blocks, the chunked loss, FSDP2's units,
compile and the export find what they expect), each targeted linear becomes
`<name>.base_layer` + `<name>.lora_A.default` / `lora_B.default`, and every other parameter is
frozen. The skeleton is on the meta device, so the adapters are too: their initial values are
computed here by peft's own initialisation on small CPU tensors, kept, and copied into whatever
each rank holds once the strategy has materialized it (fill_adapters), like the base weights
are copied from the safetensors files.
"""

from __future__ import annotations

import torch
from torch import nn

from cputrain.config import LLAMA_PROJECTIONS, LoraConfig
from cputrain.errors import ModelError, one_line
from cputrain.model.score_head import SCORE

ADAPTER = "default"  # peft's adapter name; the exported folder holds this one adapter


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last name parts of the model's linear layers, in model order (what
    target_modules can name)."""
    names = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf not in names:
            names.append(leaf)
    return names


def _matches(module_name: str, target: str) -> bool:
    # peft's rule for a list of names: the whole name, or its last dotted parts
    return module_name == target or module_name.endswith("." + target)


def target_modules_choice(model: nn.Module, cfg: LoraConfig) -> tuple[list[str], str]:
    """model.lora.target_modules=auto for this model (its skeleton is enough), and why."""
    if cfg.target_modules != "auto":
        return list(cfg.target_modules), ""
    names = target_modules(model, cfg)
    if names == list(LLAMA_PROJECTIONS):
        return names, ("every attention and MLP projection of each block (QLoRA's choice: adapting all the "
                       "linear layers trains better than q and v alone)")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return names, f"peft's default targets for model type '{model_type}' (no Llama-style projections)"


def target_modules(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """The names the adapters go on, checked against the model's linear layers."""
    linears = linear_layer_names(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if cfg.target_modules == "auto":
        if all(name in linears for name in LLAMA_PROJECTIONS):
            return list(LLAMA_PROJECTIONS)
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

        if model_type not in PEFT_DEFAULTS:
            raise ModelError(
                f"peft has no default LoRA targets for model type '{model_type}' and it has no Llama-style "
                f"projections; set model.lora.target_modules to some of its linear layers: {', '.join(linears)}"
            )
        return list(PEFT_DEFAULTS[model_type])
    linear_modules = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for target in cfg.target_modules:
        if not any(_matches(name, target) for name in linear_modules):
            raise ModelError(
                f"model.lora.target_modules: '{target}' names no linear layer of this {model_type or 'model'}; "
                f"its linear layers are: {', '.join(linears)}"
            )
    return list(cfg.target_modules)


def check_rank(model: nn.Module, cfg: LoraConfig) -> None:
    """An adapter's rank below the width of every layer it goes on: at r ≥ min(d_in, d_out) the
    update B·A is no longer low-rank, and it has more parameters than the layer it adapts."""
    targets = target_modules(model, cfg)
    widths = {name: min(m.in_features, m.out_features) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and any(_matches(name, t) for t in targets)}
    if not widths:
        return
    narrowest = min(widths, key=widths.get)
    if cfg.rank >= widths[narrowest]:
        raise ModelError(f"model.lora.rank {cfg.rank} is not below the width of {narrowest} ({widths[narrowest]}): "
                         f"such an adapter is a full-rank update with more parameters than the layer; use a rank "
                         f"below {widths[narrowest]} (8–64 is usual), or full fine-tuning (model.lora.enabled=false)")


def peft_config(model: nn.Module, cfg: LoraConfig, base_path: str | None = None):
    from peft import LoraConfig as PeftLoraConfig

    # A reward model's folder is peft's sequence classification (its head saved with the adapters,
    # modules_to_save), so PeftModel and transformers load it onto AutoModelForSequenceClassification.
    # The skeleton itself gets no modules_to_save: the head stays one plain trained parameter.
    classifier = isinstance(getattr(model, SCORE, None), nn.Linear)
    return PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=target_modules(model, cfg),
        init_lora_weights=cfg.init_weights, bias="none", task_type="SEQ_CLS" if classifier else "CAUSAL_LM",
        base_model_name_or_path=base_path,
    )


def is_adapter_parameter(name: str) -> bool:
    """A parameter peft added: it is not in the base model's files."""
    return ".lora_" in name


def is_exported_parameter(name: str) -> bool:
    """What the adapter folder holds: the adapters, and a reward model's score head (trained with them)."""
    return is_adapter_parameter(name) or name == f"{SCORE}.weight"


def base_file_name(param_name: str) -> str | None:
    """The name of `param_name` in the base model's files: None for an adapter (in no file), and a
    layer with adapters keeps its own weight as `<layer>.base_layer.weight`, stored as `<layer>.weight`."""
    if is_adapter_parameter(param_name):
        return None
    return param_name.replace(".base_layer.", ".")


def lora_layers(model: nn.Module):
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def add_adapters(model: nn.Module, cfg: LoraConfig, frozen_dtype: torch.dtype, seed: int,
                 base_path: str | None = None, compute_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Put LoRA adapters into the skeleton `model` in place, freeze the rest and store it in
    `frozen_dtype` for computing in `compute_dtype` (default: the same; see
    cputrain.lora.base_storage); return the adapters' initial values (parameter name → full fp32
    tensor)."""
    from peft import inject_adapter_in_model

    from cputrain.lora.base_storage import store_frozen

    compute_dtype = compute_dtype or frozen_dtype

    check_rank(model, cfg)
    config = peft_config(model, cfg, base_path)
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(f"peft could not add LoRA adapters to this model: {one_line(exc)}") from None
    head = getattr(model, SCORE, None)
    if isinstance(head, nn.Linear):  # a reward model's score head is trained with the adapters (fp32 masters)
        head.weight.requires_grad_(True)
    # Frozen weights need no fp32 master copy: no gradient or optimizer step ever touches them.
    store_frozen(model, frozen_dtype, compute_dtype)
    initial = {}
    # peft's own initialisation, on CPU tensors, from the run's seed (the same on every rank),
    # without touching the global generator the data order and dropout draw from.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, layer in lora_layers(model):
            a, b = layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]
            a.to_empty(device="cpu")
            b.to_empty(device="cpu")
            if cfg.init_weights is False:  # peft's init_lora_weights=False: both as nn.Linear draws them
                a.reset_parameters()
                b.reset_parameters()
            else:
                layer.reset_lora_parameters(ADAPTER, cfg.init_weights)
            initial[f"{name}.lora_A.{ADAPTER}.weight"] = a.weight.detach().clone()
            initial[f"{name}.lora_B.{ADAPTER}.weight"] = b.weight.detach().clone()
            a.to("meta")
            b.to("meta")
            if compute_dtype == torch.bfloat16:
                # peft casts a layer's input to the adapter's dtype (fp32) before A; under bf16
                # autocast that is a round trip to fp32 and back per layer for nothing.
                layer.cast_input_dtype_enabled = False
    return initial


def fill_adapters(model: nn.Module, initial: dict[str, torch.Tensor]) -> None:
    """Copy the adapters' initial values into the materialized (possibly sharded) model."""
    from cputrain.model import copy_full_into

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, full in initial.items():
            copy_full_into(params[name], full)
