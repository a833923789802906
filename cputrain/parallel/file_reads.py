"""Weights read from safetensors files with plain reads, straight into the tensors that keep them.

safetensors' own reader maps the file; every page a read touches then counts in this process's
RSS until the file is closed, which puts a second copy of the weights (or of this rank's shard)
on top of the parameters at the peak of loading: 16 GB more for an 8B base. A run of rows of
dim 0 is one contiguous byte range in the file (row-major, the format's layout), so it is read
with `readinto` into the parameter's own memory instead: the page cache holds the file, the
process holds only its parameters. A tensor stored in another dtype (a bf16 file into fp32
parameters) is read into a buffer of its own size, then cast: one tensor at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cputrain.errors import ModelError
from cputrain.model import SafetensorsReader

# safetensors dtype names (the file header's) for the dtypes read directly
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class PlainReads:
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

    def __enter__(self) -> PlainReads:
        return self

    def __exit__(self, *exc) -> None:
        for f in self.files:
            f.close()

    def copy_rows(self, key: str, target: torch.Tensor, rows: slice, reader: SafetensorsReader) -> None:
        """Rows `rows` of dim 0 of the file's tensor `key` into `target` (exactly those rows)."""
        n_rows = rows.stop - rows.start
        if n_rows <= 0:
            return
        f, dtype, start = self.where[key]
        if dtype is None or not target.is_contiguous() or target.shape[0] != n_rows:
            target.copy_(reader.read(key, rows=rows))  # an unusual dtype or layout: through safetensors
            return
        buffer = target if dtype == target.dtype else torch.empty(target.shape, dtype=dtype)
        row_bytes = buffer[0].numel() * buffer.element_size()
        f.seek(start + rows.start * row_bytes)
        if f.readinto(memoryview(buffer.view(torch.uint8).numpy()).cast("B")) != n_rows * row_bytes:
            raise ModelError(f"'{key}' is cut short in {f.name}; the file may be truncated")
        if buffer is not target:
            target.copy_(buffer)

    def copy_whole(self, name: str, param: torch.Tensor, reader: SafetensorsReader, key: str) -> None:
        """load_into's copy_fn for a rank that holds whole parameters (single, ddp)."""
        if param.dim() == 0:  # a scalar has no rows
            param.copy_(reader.read(key))
        else:
            self.copy_rows(key, param, slice(0, param.shape[0]), reader)
