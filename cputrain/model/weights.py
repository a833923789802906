"""Filling a skeleton: storage for its parameters, then values from the safetensors files or at random.

No tensor exists twice: the strategies read each parameter with plain file reads straight into its
final storage (under FSDP, only this rank's rows; cputrain.parallel.file_reads); the headers are
read through safetensors' own reader."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from cputrain.errors import ModelError, first_line


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
                    f"weights file '{path}' is corrupt or truncated ({first_line(exc)}); re-download or re-export it"
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
            raise ModelError(f"could not read '{name}' from the weights ({first_line(exc)}); the file may be truncated") from None


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
