"""The precomputed reference log-probabilities of DPO (each pair's two sequences) and KTO (each
example and its KL sequence), kept beside the token cache and computed once:
a resumed run, a second epoch's session and a later run on the same pairs read them back.

The file lives in the token cache's entry (which is keyed by the data, tokenizer and cut), named
by what else the numbers depend on: the reference weights (the starting model folder's files,
by name, size and modification time: a changed or copied folder is computed again), and the
numerics (precision, attention kernel, the head's path). A run from random weights has no folder
to key by, and computes its reference each session.

Computing them is split across the ranks: each runs the no-grad forwards of its share of the rows
(every rank the same number of forwards, which sharded strategies need), then one all-reduce sums
the shares into the whole table on every rank. One writer per node saves the file (atomically).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from cputrain.distributed import process_group as pg

log = logging.getLogger("cputrain")


@dataclass(frozen=True)
class ReferenceStore:
    path: Path | None  # None: nothing to key the numbers by (random weights, no token cache folder)
    rank: int
    world_size: int
    local_rank: int

    def load(self, rows: list) -> list[torch.Tensor] | None:
        """Every split's table where every rank finds the file (else all compute: a collective)."""
        tables = _read(self.path, rows) if self.path is not None else None
        (missing,) = pg.all_reduce_sum([0.0 if tables is not None else 1.0])
        return tables if missing == 0 else None

    def share(self, rows: int) -> tuple[np.ndarray, bool]:
        """This rank's rows of a split, padded with its own last row to as many as any rank has
        (so every rank runs the same number of forwards), and whether it owns any: an empty share
        is padded with row 0, whose numbers the rank must then drop."""
        own = np.array_split(np.arange(rows), self.world_size)[self.rank]
        longest = -(-rows // self.world_size)
        padded = np.concatenate([own, np.full(longest - len(own), own[-1] if len(own) else 0)]).astype(np.int64)
        return padded, len(own) > 0

    def combine(self, tables: list[torch.Tensor]) -> list[torch.Tensor]:
        """The ranks' tables (each holding its own rows' numbers, 0 elsewhere) summed into the whole."""
        if self.world_size > 1 and dist.is_initialized():
            flat = torch.cat(tables)
            dist.all_reduce(flat)
            tables = list(flat.split([len(t) for t in tables]))
        return tables

    def fill(self, rows: list, compute, base) -> bool:
        """Every split of `rows` given its table (split.reference_logps): read from the file where
        every rank finds it (True), else computed inside the context `base` (the converter's
        reference, or none), this rank its share of each split's rows (`compute(split, indices)`:
        a table with those rows' numbers, 0 elsewhere), summed over the ranks and saved (False)."""
        tables = self.load(rows)
        read = tables is not None
        if not read:
            tables = []
            with base:
                for split in rows:
                    split.reference_logps = None
                    indices, owns_any = self.share(len(split))
                    table = compute(split, indices)
                    tables.append(table if owns_any else table.zero_())
            tables = self.combine(tables)
            self.save(tables)
        for split, table in zip(rows, tables):
            split.reference_logps = table
        return read

    def save(self, tables: list[torch.Tensor]) -> None:
        if self.path is None or self.local_rank != 0 or self.path.exists():
            return
        from safetensors.torch import save_file

        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        save_file({f"split{i}": t.contiguous() for i, t in enumerate(tables)}, str(tmp))
        os.replace(tmp, self.path)


def _read(path: Path, rows: list) -> list[torch.Tensor] | None:
    from safetensors.torch import load_file

    try:
        saved = load_file(str(path))
    except (OSError, ValueError, RuntimeError):  # absent, or damaged: computed again
        return None
    tables = [saved.get(f"split{i}") for i in range(len(rows))]
    if any(t is None or len(t) != split.reference_sequences for t, split in zip(tables, rows)):
        return None
    return tables


def reference_file(cache_folder: Path | None, weights_folder: Path | None, cfg) -> Path | None:
    """reference-<key>.safetensors in the token cache's entry, or None where nothing keys it."""
    if cache_folder is None or weights_folder is None:
        return None
    weights_folder = Path(weights_folder).resolve()
    files = sorted(p for p in weights_folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin", ".json"))
    parts = {
        "weights": [str(weights_folder)] + [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "precision": cfg.hardware.precision,
        "attention": cfg.model.attn_implementation,
        "chunked_head": bool(cfg.model.chunked_loss),
        "lora": bool(cfg.model.lora.enabled),  # the base as the LoRA converter stores it, or the full weights
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_folder) / f"reference-{key}.safetensors"


def reference_chunks(split, micro_batch: int, indices=None):
    """(the row numbers, their batch) of `split`'s rows `indices` (all where None), `micro_batch`
    rows at a time: what a reference table is computed over."""
    indices = np.arange(len(split)) if indices is None else np.asarray(indices)
    for start in range(0, len(indices), micro_batch):
        chunk = indices[start : start + micro_batch]
        yield chunk, split.batch(chunk)


def prepare_reference(store: ReferenceStore | None, rows: list, compute, model, reference, what: str,
                      counted: str, setting: str = "") -> None:
    """Every split of `rows` given its reference table: read from `store`'s file, else computed
    (`compute(split, indices)`) before training inside the converter's reference (`reference`,
    None: the weights as loaded) across the store's ranks; logged as `what` ("DPO", "KTO") of
    `counted` ("12 pairs"), `setting` naming the setting that chose it (e.g. "train.dpo_reference=precompute: ")."""
    store = store or ReferenceStore(None, 0, 1, 0)
    started_s = time.perf_counter()
    model.eval()
    base = reference(model) if reference is not None else contextlib.nullcontext()
    if store.fill(rows, compute, base):
        log.info("%s reference: the log-probabilities of %s read from %s", what, counted, store.path)
        return
    log.info("%s reference: the log-probabilities of %s computed before training in %.1f s over %d rank(s) (%s%s)%s",
             what, counted, time.perf_counter() - started_s, store.world_size, setting,
             "the base, adapters off" if reference is not None else "the weights as loaded",
             f"; kept in {store.path}" if store.path is not None else "")
