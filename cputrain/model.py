"""The model: a Hugging Face causal LM, built as a skeleton first and filled from safetensors.

Loading a pretrained model goes skeleton-on-meta → (strategy shards it) → materialize → copy
tensors from the safetensors files. No tensor exists twice: the strategies read each parameter
with plain file reads straight into its final storage (under FSDP, only this rank's rows;
cputrain.parallel.file_reads); the headers are read through safetensors' own reader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cputrain.config import ModelConfig, checkpointed_blocks
from cputrain.errors import ModelError, one_line

log = logging.getLogger("cputrain")


@dataclass
class ModelSource:
    """Where weights come from: a folder with config.json + *.safetensors, or nothing (random init)."""

    folder: Path | None
    hf_config: object  # transformers PretrainedConfig


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def config_from_arch(arch: dict, vocab_size: int | None):
    """The transformers config that `model.arch` describes; the library validates every key
    (integers, heads dividing the hidden size) and its whole message is reported."""
    from transformers import CONFIG_MAPPING

    arch = dict(arch)
    model_type = arch.pop("model_type", "llama")
    if model_type not in CONFIG_MAPPING:
        raise ModelError(f"model.arch.model_type '{model_type}' is not a transformers model type")
    try:
        return CONFIG_MAPPING[model_type](**arch, vocab_size=vocab_size)
    except Exception as exc:
        raise ModelError(f"model.arch does not make a valid {model_type} config: {one_line(exc)}") from None


def folder_config(cfg: ModelConfig, folder: Path):
    """The transformers config of a model folder, after its config.json was checked for the sizes."""
    from transformers import AutoConfig

    from cputrain.model_config_file import read_config_json

    read_config_json(folder / "config.json", trust_remote_code=cfg.trust_remote_code)
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:
        raise ModelError(f"could not read the model config in '{cfg.name_or_path}': {one_line(exc)}") from None


def resolve_source(cfg: ModelConfig, vocab_size: int | None) -> ModelSource:
    if cfg.name_or_path is None:
        return ModelSource(None, config_from_arch(cfg.arch, vocab_size))
    folder = local_folder(cfg.name_or_path)
    return ModelSource(folder, folder_config(cfg, folder))


def local_folder(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model folder '{path}' has no config.json; point model.name_or_path at a Hugging Face model folder")
        return path
    if path.exists():
        raise ModelError(f"model.name_or_path '{path}' is a file; it must be a model folder")
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise ModelError(f"model folder '{name_or_path}' not found; check model.name_or_path")
    # A hub id ("org/name"): fetch only the config, tokenizer and safetensors into the HF cache.
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:
        raise ModelError(f"model '{name_or_path}' is not a local folder and could not be fetched: {_first_line(exc)}") from None


def safetensors_header(path: Path) -> dict:
    """A safetensors file's JSON header (each tensor's dtype, shape and offsets, and
    `__metadata__`); no weight is read. ValueError when the file is not one."""
    import json

    with open(path, "rb") as f:  # the format: u64 header length, the JSON header, the data
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > path.stat().st_size - 8:
            raise ValueError(f"'{path}' is not a safetensors file: its header length runs past its end")
        header = json.loads(f.read(header_len))
    if not isinstance(header, dict):
        raise ValueError(f"'{path}' is not a safetensors file: its header is not a JSON object")
    return header


def safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"'{folder}' has no .safetensors weights; only safetensors are loaded (convert .bin files with "
            "transformers' save_pretrained(safe_serialization=True))"
        )
    return files


def build_skeleton(source: ModelSource, cfg: ModelConfig) -> nn.Module:
    """The model with every parameter on the meta device: structure, no storage."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                source.hf_config,
                # "auto" is decided by timing (trainer); a skeleton built before that, for a plan, is the same either way
                attn_implementation="sdpa" if cfg.attn_implementation == "auto" else cfg.attn_implementation,
                trust_remote_code=cfg.trust_remote_code,
                dtype=torch.float32,  # master weights stay fp32; bf16 is a compute choice (autocast)
            )
    except Exception as exc:
        raise ModelError(f"could not build the model from its config: {_first_line(exc)}") from None
    return model


def materialize(model: nn.Module) -> None:
    """Give meta parameters real (uninitialised) CPU storage and recompute non-persistent buffers."""
    model.to_empty(device="cpu")
    # Rotary inverse frequencies are computed, not saved: recompute them (HF's own init does).
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq"):
            model._init_weights(module)


def random_init(model: nn.Module, seed: int) -> None:
    """Initialise every parameter the way transformers does, from `seed` (same on every rank)."""
    torch.manual_seed(seed)
    for module in model.modules():
        module._is_hf_initialized = False
    model.initialize_weights()
    model.tie_weights()


class SafetensorsReader:
    """Maps parameter names to tensors across a model's safetensors files, without loading them."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.handles, self.where = [], {}
        for path in safetensors_files(folder):
            try:
                handle = safe_open(str(path), framework="pt")
                keys = list(handle.keys())
            except Exception as exc:
                raise ModelError(
                    f"weights file '{path}' is corrupt or truncated ({_first_line(exc)}); re-download or re-export it"
                ) from None
            self.handles.append(handle)
            for key in keys:
                self.where[key] = handle

    def shape(self, name: str) -> list[int]:
        return list(self.where[name].get_slice(name).get_shape())

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """The tensor `name`, or only `rows` of its first dimension (what one FSDP shard needs)."""
        try:
            if rows is None:
                return self.where[name].get_tensor(name)
            return self.where[name].get_slice(name)[rows]
        except Exception as exc:
            raise ModelError(f"could not read '{name}' from the weights ({_first_line(exc)}); the file may be truncated") from None


def checkpoint_name(param_name: str, reader: SafetensorsReader) -> str | None:
    """The key under which `param_name` is stored (wrappers add prefixes; some files drop `model.`)."""
    for candidate in (param_name, param_name.removeprefix("model."), f"model.{param_name}"):
        if candidate in reader.where:
            return candidate
    return None


def load_into(
    model: nn.Module,
    folder: Path,
    copy_fn: Callable[[str, torch.Tensor, SafetensorsReader, str], None] | None = None,
    shape_of: Callable[[torch.Tensor], list[int]] = lambda param: list(param.shape),
    file_name_of: Callable[[str], str | None] = lambda name: name,
) -> None:
    """Copy every parameter from the safetensors files into the materialized `model`.

    `copy_fn(param_name, param, reader, key)` lets a strategy copy only what its rank owns; the
    default copies the whole tensor. `shape_of` is a parameter's full shape (a DTensor's
    `shape` is already the global one; a ZeRO-3 partition keeps it in ds_shape). `file_name_of`
    is the model converter's: the name a parameter has in the files, or None for one the files
    do not hold (LoRA's adapters, which the converter fills).
    """
    reader = SafetensorsReader(folder)
    keys = matching_keys(model, reader, shape_of, file_name_of)
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=True):
            if name in keys:
                (copy_fn or _copy_whole)(name, param, reader, keys[name])
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def matching_keys(
    model: nn.Module,
    reader: SafetensorsReader,
    shape_of: Callable[[torch.Tensor], list[int]] = lambda param: list(param.shape),
    file_name_of: Callable[[str], str | None] = lambda name: name,
) -> dict[str, str]:
    """{parameter name: its key in the files}, after checking that the files hold every parameter
    in its shape (from the headers alone: no tensor is read). A tied lm_head may be absent."""
    tied = {id(p) for n, p in model.named_parameters() if n.endswith("lm_head.weight")} if getattr(
        model.config, "tie_word_embeddings", False
    ) else set()
    keys, missing = {}, []
    for name, param in model.named_parameters(remove_duplicate=True):
        in_files = file_name_of(name)
        if in_files is None:
            continue
        key = checkpoint_name(in_files, reader)
        if key is None:
            if id(param) not in tied:
                missing.append(name)
            continue
        full_shape = reader.shape(key)
        if shape_of(param) != full_shape:
            raise ModelError(
                f"weights for '{name}' have shape {full_shape}, the model expects {shape_of(param)}; "
                "the weights do not belong to this model config"
            )
        keys[name] = key
    if missing:
        raise ModelError(f"weights file lacks {len(missing)} parameters of the model (first: '{missing[0]}'); wrong model folder?")
    return keys


def _copy_whole(name: str, param: torch.Tensor, reader: SafetensorsReader, key: str) -> None:
    param.copy_(reader.read(key))


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole tensor `full` into what this rank holds of `param`: all of it, or for an
    FSDP2 DTensor its own rows. Every rank holds the same `full`, so nothing is scattered."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def check_vocab(model_config, tokenizer) -> None:
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ModelError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {vocab}; "
            "use the tokenizer that belongs to the model (model.tokenizer)"
        )


def enable_activation_checkpointing(model: nn.Module, setting: bool | int = True) -> None:
    """Checkpoint the model's blocks as model.activation_checkpointing says (resolved: true, false
    or a number of blocks, the first ones). The others keep their activations: transformers checks
    each block's own `gradient_checkpointing` flag at every call."""
    if not setting:  # false or 0
        return
    # Non-reentrant checkpointing composes with FSDP2 and torch.compile.
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x: the other name warns on every run
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if setting is not True:  # N blocks: any architecture with findable blocks (true needs none)
        blocks = decoder_blocks(model)
        for block in blocks[checkpointed_blocks(setting, len(blocks)):]:
            block.gradient_checkpointing = False


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (model.model.layers in Llama-style HF models)."""
    for attr in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        node = model
        for part in attr.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, nn.ModuleList):
            return list(node)
    raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}")


def compile_blocks(model: nn.Module, cache_dir: str) -> None:
    """Compile each decoder block's forward in place (regional compilation).

    The blocks are identical, so inductor compiles one and reuses it; the embedding, the head
    and the loss stay eager. Only `forward` is compiled, not the module call: the hooks that
    DDP, FSDP2 and DeepSpeed put on a block stay outside the graph, and parameter names (so
    checkpoints and the export) are those of an eager run. benchmarks/step_profile.py measures
    it against eager on the machine at hand (docs/benchmarks.md).
    """
    import os

    # Inductor keeps compiled kernels here between runs, so only the first run pays for compiling.
    # Assigned, not defaulted: torch writes its own default (/tmp/torchinductor_<user>) into the
    # variable the first time anything asks for the folder, which can be before this call.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    for block in decoder_blocks(model):
        block.forward = torch.compile(block.forward)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Total and non-embedding parameters (the input embedding table is a lookup, not a matmul),
    and the non-embedding ones that are trained (all of them, or only LoRA adapters)."""
    params = list(model.parameters())  # each shared parameter once
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    emb = model.get_input_embeddings().weight
    tied = getattr(model.config, "tie_word_embeddings", False)
    # A tied lm_head still does a vocab × hidden matmul per token: keep it in the compute count.
    non_embedding = total - emb.numel() + (emb.numel() if tied else 0)
    trained_non_embedding = trained - (emb.numel() if emb.requires_grad and not tied else 0)
    return {"total": total, "non_embedding": non_embedding, "embedding": emb.numel(),
            "trained": trained, "trained_non_embedding": trained_non_embedding}

