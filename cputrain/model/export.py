"""The final `model/` folder: a plain Hugging Face model that needs nothing from cputrain, and says
what it holds as a published model does (cputrain.model.folder_description: its class, the dtype
of its weights, where a generation ends).

Tensors arrive one at a time (under FSDP each is gathered just before it is written) and are
flushed to a new safetensors shard every `max_shard_bytes`, so at most one shard of gathered
weights exists beside the rank's own state: never two full copies of the model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from cputrain.model.folder_description import describe_model_folder


def _shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def export_hf(
    tensors: Iterable[tuple[str, torch.Tensor]],
    hf_config,
    tokenizer,
    out_dir: str,
    is_writer: bool,
    max_shard_bytes: int = 2 * 2**30,
) -> None:
    """Write `out_dir` from (name, full tensor) pairs. Every rank iterates (gathers are
    collective); only the writer keeps and writes the tensors."""
    out = Path(out_dir)
    tmp = fresh_staging(out) if is_writer else None
    tied = getattr(hf_config, "tie_word_embeddings", False)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, shard_files, weight_map, total_bytes = 0, [], {}, 0

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"part-{len(shard_files):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            shard_files.append((name, list(shard)))
            shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        if tied and name.endswith("lm_head.weight"):
            continue  # tied to the input embedding; transformers re-ties it on load
        if not is_writer:
            continue
        # no copy: a single-process tensor is the parameter itself; an FSDP one is already a fresh gather
        shard[name] = tensor.detach().contiguous()
        shard_bytes += tensor.numel() * tensor.element_size()
        total_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= max_shard_bytes:
            flush()
    if not is_writer:
        return
    flush()
    if len(shard_files) == 1:
        os.rename(tmp / shard_files[0][0], tmp / "model.safetensors")
    else:
        n = len(shard_files)
        for i, (name, keys) in enumerate(shard_files, start=1):
            os.rename(tmp / name, tmp / _shard_name(i, n))
            weight_map.update({k: _shard_name(i, n) for k in keys})
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    describe_model_folder(tmp, tokenizer, started_from=starting_folder(hf_config))
    swap_in(tmp, out)


def starting_folder(hf_config) -> Path | None:
    """The folder of the model a run started from (transformers records it in the config it
    read), None for a model built from model.arch."""
    name = getattr(hf_config, "name_or_path", "") or ""
    return Path(name) if name and Path(name).is_dir() else None


def fresh_staging(out: Path) -> Path:
    """An empty `<out>.tmp` beside `out`, where an export is written before swap_in."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def swap_in(tmp: Path, out: Path) -> None:
    """Put the finished export in place of the old one only once it is whole."""
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
