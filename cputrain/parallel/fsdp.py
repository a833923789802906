"""FSDP2: each rank keeps 1/W of every parameter, gradient and optimizer state.

`fully_shard` goes on each decoder block, then on the root (embeddings, final norm, head), so
a block's full weights exist only while that block runs. It is applied to the skeleton on the
meta device, before any weight exists: materializing then allocates only this rank's shard,
and loading copies only this rank's rows from the safetensors files. That is what keeps the
peak memory of loading near model_bytes ÷ world_size instead of model_bytes in every rank.

A model built from scratch is the exception: its random init is computed whole (on CPU, from
the seed) and each rank keeps its rows, so that every strategy starts from the same weights.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from cputrain.distributed.allocator import pin_mmap_threshold
from cputrain.errors import ModelError
from cputrain.model import (SafetensorsReader, copy_full_into, decoder_blocks, load_into, materialize, random_init,
                            safetensors_files)
from cputrain.parallel.base import Strategy, StrategyContext


def owned_rows(param: DTensor) -> slice:
    """Rows of dim 0 this rank holds under FSDP2's Shard(0): torch.chunk's split, last ones may be empty."""
    rows = param.shape[0]
    world = param.device_mesh.size()
    rank = param.device_mesh.get_local_rank()
    per = -(-rows // world)
    start = min(rows, rank * per)
    return slice(start, min(rows, start + per))


# safetensors dtype names (the file header's) for the dtypes a shard can be read into directly
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class RowFiles:
    """Reads a tensor's rows from the safetensors files straight into this rank's shard.

    safetensors' own reader maps the file; every page a slice touches then counts in this
    process's RSS until the file is closed, which would add a second copy of the shard to the
    peak of loading. Rows of dim 0 are one contiguous byte range in the file (row-major, the
    format's layout), so they are read with plain file reads into the shard's own memory: the
    page cache holds the file, the process holds only its shard.
    """

    def __init__(self, files: list[Path]):
        self.where: dict[str, tuple[object, torch.dtype | None, int]] = {}  # key -> (file, dtype, data start)
        self.files = []
        for path in files:
            f = open(path, "rb")  # noqa: SIM115  closed in close()
            self.files.append(f)
            header_len = int.from_bytes(f.read(8), "little")  # the format: u64 length, JSON header, data
            header = json.loads(f.read(header_len))
            for key, entry in header.items():
                if key != "__metadata__":
                    self.where[key] = (f, _DTYPES.get(entry["dtype"]), 8 + header_len + entry["data_offsets"][0])

    def copy_owned_rows(self, name: str, param: torch.Tensor, reader: SafetensorsReader, key: str) -> None:
        local = param.to_local()
        rows = owned_rows(param)
        if rows.stop <= rows.start:
            return
        f, dtype, start = self.where[key]
        n_rows = rows.stop - rows.start
        if dtype != local.dtype or not local.is_contiguous() or local.shape[0] != n_rows:
            local.copy_(reader.read(key, rows=rows))  # a dtype cast or an odd layout: through safetensors
            return
        row_bytes = local[0].numel() * local.element_size()
        target = memoryview(local.view(torch.uint8).numpy()).cast("B")
        f.seek(start + rows.start * row_bytes)
        if f.readinto(target) != n_rows * row_bytes:
            raise ModelError(f"'{key}' is cut short in {f.name}; the file may be truncated")

    def close(self) -> None:
        for f in self.files:
            f.close()


class FSDPStrategy(Strategy):
    name = "fsdp"
    metered = True

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        pin_mmap_threshold()  # before the init replica and the first step free anything

    def wrap(self, model: nn.Module) -> nn.Module:
        kwargs = {}
        if self.ctx.compute_dtype == torch.bfloat16:
            # bf16 compute, fp32 master weights and fp32 gradient reduction (bf16 sums lose bits).
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in decoder_blocks(model):
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def load_weights(self, model: nn.Module, folder: Path | None) -> None:
        materialize(model)  # allocates only this rank's shard of every parameter
        if folder is not None:
            files = RowFiles(safetensors_files(folder))
            try:
                load_into(model, folder, copy_fn=files.copy_owned_rows, file_name_of=self.ctx.file_name_of)
            finally:
                files.close()
            return
        full = self._full_random_init(model, self.ctx.cfg.seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                copy_full_into(param, full[name])  # every rank computed the same init: no scatter

    @staticmethod
    def _full_random_init(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            replica = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        materialize(replica)
        random_init(replica, seed)
        return dict(replica.named_parameters())

    def autocast(self):
        # The mixed-precision policy casts parameters to bf16 itself; autocast on top would only add casts.
        return contextlib.nullcontext()

    # full_state_dict: the protocol's own, which gathers one parameter at a time (full_tensor),
    # so at most one full tensor exists beside this rank's shards.

    def close(self) -> None:
        super().close()
        # DTensor's sharding-propagation caches keep the specs of every op seen, and through their
        # device mesh the process group: cleared, the group can be destroyed before teardown.
        try:
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache
        except ImportError:  # a torch without it keeps the group until exit, as before
            return
        _clear_sharding_prop_cache()


def build(ctx: StrategyContext) -> Strategy:
    return FSDPStrategy(ctx)

