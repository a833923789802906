"""Memory at each setup phase and at the peak of a training step: memory.json and a table.

Phase names are stable (the memory planner compares its estimates against them):
process group, model skeleton, sharded weights, optimizer created, first step done,
training step peak. Bytes are this rank's own: under FSDP or ZeRO-3, its shard.
"""

from __future__ import annotations

import json
import logging

import torch

from cputrain.metrics import memory

log = logging.getLogger("cputrain")

PHASES = (
    "process group",
    "model skeleton",
    "sharded weights",
    "optimizer created",
    "first step done",
    "training step peak",
)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        if t.device.type == "meta" or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def state_bytes(model=None, optimizer=None) -> dict[str, int]:
    out = {"param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0}
    if model is not None:
        params = list(model.parameters())
        out["param_bytes"] = tensor_bytes(params)
        out["grad_bytes"] = tensor_bytes(p.grad for p in params)
    if optimizer is not None:
        out["optimizer_bytes"] = tensor_bytes(
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
    return out


class PhaseRecorder:
    def __init__(self, rank: int):
        self.rank = rank
        self.rows: list[dict] = []
        self.extra_bytes_fn = None  # a strategy may report state it keeps outside torch (DeepSpeed)

    def mark(self, phase: str, model=None, optimizer=None, use_peak: bool = False, **extra) -> None:
        assert phase in PHASES, phase
        row = {"phase": phase, "rss_gib": memory.peak_rss_gib() if use_peak else memory.rss_gib(),
               "peak_rss_gib": memory.peak_rss_gib()}
        row.update(state_bytes(model, optimizer))
        if self.extra_bytes_fn is not None:
            row.update({k: v for k, v in self.extra_bytes_fn().items() if v})
        row.update(extra)
        self.rows.append(row)

    def write(self, run, ranks) -> None:
        """Gather every rank's rows to rank 0, which writes memory.json and prints the table."""
        import torch.distributed as dist

        all_rows = [self.rows]
        if dist.is_initialized():
            all_rows = [None] * dist.get_world_size()
            dist.all_gather_object(all_rows, self.rows)
        if not ranks.is_main:
            return
        doc = {"ranks": [{"rank": r, "phases": rows} for r, rows in enumerate(all_rows)]}
        run.write_text(json.dumps(doc, indent=2), "memory.json")
        for line in table(doc):
            log.info(line)


def table(doc: dict) -> list[str]:
    gib = 2**30
    lines = [f"{'rank':>4}  {'phase':<20} {'RSS GiB':>8} {'params GiB':>10} {'grads GiB':>10} {'optim GiB':>10}"]
    for r in doc["ranks"]:
        for row in r["phases"]:
            lines.append(
                f"{r['rank']:>4}  {row['phase']:<20} {row['rss_gib']:8.3f} {row['param_bytes'] / gib:10.4f} "
                f"{row['grad_bytes'] / gib:10.4f} {row['optimizer_bytes'] / gib:10.4f}"
            )
    return lines
