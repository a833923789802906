"""The dtype a LoRA run stores its frozen base in (model.lora.base_dtype), and the storage itself.

A frozen weight needs no fp32 master: nothing updates it. Llama-3's files hold bf16, so a bf16
copy loses nothing, at half the bytes of fp32: 15 GiB instead of 30 for the 8B model, which
then fits a 24 GiB machine. Where the compute is bf16 (AMX, AVX512-BF16) the matmuls read that
copy as it is. Where it is fp32 (a CPU without bf16 units, where a bf16 matmul is emulated),
the linear layers and the embedding convert their bf16 weight to fp32 for each use
(cputrain.kernels.upcast_linear); the rest of the frozen base (norms, biases) is kept in fp32:
it is small, and the ops that use it are not linear layers.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from torch import nn

from cputrain.kernels.upcast_linear import upcast_linear

BASE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def files_are_bf16(folder: Path) -> bool:
    """Every floating-point matrix in the folder's safetensors files is bf16 (headers only read;
    False for a broken file, which loading then names)."""
    from cputrain.model import safetensors_header

    dtypes = set()
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            header = safetensors_header(path)
        except (OSError, ValueError):
            return False
        dtypes |= {entry["dtype"] for key, entry in header.items()
                   if key != "__metadata__" and len(entry.get("shape", ())) >= 2 and entry["dtype"].startswith(("F", "BF"))}
    return dtypes == {"BF16"}


def base_dtype_name(dtype: torch.dtype) -> str:
    """The config's name for a base dtype (model.lora.base_dtype)."""
    return next(name for name, value in BASE_DTYPES.items() if value == dtype)


def base_dtype_choice(asked: str, compute_dtype: torch.dtype, files_bf16: bool) -> tuple[torch.dtype, str]:
    """model.lora.base_dtype as resolved, with the reason."""
    if asked != "auto":
        return BASE_DTYPES[asked], f"model.lora.base_dtype={asked}"
    if compute_dtype == torch.bfloat16:
        return torch.bfloat16, "bf16 compute: the matmuls read the bf16 base as it is"
    if files_bf16:
        return torch.bfloat16, ("the files hold bf16, so storing them in bf16 loses nothing at half fp32's bytes; "
                                "each layer's weight is converted to fp32 for its matmul")
    return torch.float32, "fp32 compute on weight files that are not bf16"


def _cast_output(dtype: torch.dtype, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    return output.to(dtype)


def store_frozen(model: nn.Module, base_dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
    """Store every frozen parameter of `model` (a skeleton, on any device) for a LoRA run:

    - base dtype = compute dtype: every frozen parameter in it, used as it is;
    - a bf16 base under fp32 compute: the linear layers' and embeddings' weights in bf16, each
      linear computing through upcast_linear and each embedding returning fp32 rows; every other
      frozen parameter in fp32;
    - an fp32 base under bf16 compute: autocast casts each weight for its matmul, as it does for
      a full fine-tune's fp32 masters.
    """
    narrow = base_dtype == torch.bfloat16 and compute_dtype == torch.float32
    stored_narrow = set()
    if narrow:
        for module in model.modules():
            if isinstance(module, nn.Linear) and _frozen(module):
                module.forward = partial(_linear_forward, module)
            elif isinstance(module, nn.Embedding) and _frozen(module):
                module.register_forward_hook(partial(_cast_output, compute_dtype))
            else:
                continue
            stored_narrow.add(id(module.weight))
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(base_dtype if (not narrow or id(param) in stored_narrow) else compute_dtype)


def _frozen(module: nn.Module) -> bool:
    return not any(p.requires_grad for p in module.parameters(recurse=False))


def _linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return upcast_linear(x, module.weight, module.bias)
