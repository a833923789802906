"""Memory at each setup phase and at the peak of a training step: memory.json and a table.

Phase names are stable (the memory planner compares its estimates against them):
process group, model skeleton, sharded weights, optimizer created, first step done,
training step peak. Bytes are this rank's own: under FSDP or ZeRO-3, its shard.
"""

from __future__ import annotations

import json
import logging
import os

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


def _storage(t: torch.Tensor):
    t = _local(t)
    if t.device.type == "meta":
        return None
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else None


def storage_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages behind `tensors`, less those behind `exclude`.

    Storage, not numel: a parameter that is a view into a flat buffer (FSDP2's padded shard,
    DeepSpeed's partition groups) keeps the whole buffer alive, and two views of one buffer
    (tied weights, a gradient aliasing a flat partition) are counted once.
    """
    skip = {s[0] for s in (_storage(t) for t in exclude if t is not None) if s}
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        s = _storage(t)
        if s and s[0] not in skip:
            seen[s[0]] = s[1]
    return sum(seen.values())


def _parameters_and_grads(model) -> tuple[list, list, list]:
    params = list(model.parameters())
    return params, [p.grad for p in params], []


def state_bytes(model=None, optimizer=None, tensors_held=_parameters_and_grads) -> dict[str, int]:
    """param/grad/optimizer bytes this rank holds right now.

    `tensors_held(model)` gives the (parameter, gradient, master) tensors: the strategy's
    (DeepSpeed ZeRO-3 keeps partitions, gradient buffers and fp32 masters outside
    module.parameters()). Optimizer bytes are its state (AdamW moments) plus master copies of
    parameters it steps that are not the model's own parameters.
    """
    out = {"param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0}
    params, grads, masters = [], [], []
    if model is not None:
        params, grads, masters = tensors_held(model)
        out["param_bytes"] = storage_bytes(params)
        out["grad_bytes"] = storage_bytes(grads)
    if optimizer is not None:
        moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        masters = masters + [p for g in optimizer.param_groups for p in g["params"]]
        out["optimizer_bytes"] = storage_bytes(moments) + storage_bytes(masters, exclude=params)
    elif masters:
        out["optimizer_bytes"] = storage_bytes(masters, exclude=params)
    return out


class PhaseRecorder:
    def __init__(self, rank: int):
        self.rank = rank
        self.rows: list[dict] = []
        self.tensors_held = _parameters_and_grads  # the strategy's, once it exists (Strategy.tensors_held)
        self._hooked = False
        self._model = None
        self._at_step: dict[str, int] | None = None  # bytes held when the optimizer step began

    def _watch(self, model, optimizer) -> None:
        """Record what is held when the optimizer steps: the only moment gradients all exist
        (the strategy frees them with zero_grad(set_to_none=True) right after)."""
        if self._hooked or not hasattr(optimizer, "register_step_pre_hook"):
            return
        self._hooked, self._model = True, model

        def before_step(opt, args, kwargs):
            now = state_bytes(self._model, opt, self.tensors_held)
            if self._at_step is None:
                self._at_step = now
            else:  # DeepSpeed steps one parameter group at a time: keep the largest
                self._at_step = {k: max(v, now[k]) for k, v in self._at_step.items()}

        optimizer.register_step_pre_hook(before_step)

    def mark(self, phase: str, model=None, optimizer=None, **extra) -> None:
        """A row for `phase`: RSS now and the high-water mark, then the state bytes; `extra` may
        set measured figures of its own (the step peak is measured around the steps)."""
        assert phase in PHASES, phase
        row = {"phase": phase, "rss_gib": memory.rss_gib(), "peak_rss_gib": memory.peak_rss_gib()}
        row.update(state_bytes(model, optimizer, self.tensors_held))
        if phase in ("first step done", "training step peak") and self._at_step is not None:
            # After the step the gradients are gone; their bytes are those measured inside it.
            row.update({k: max(row[k], v) for k, v in self._at_step.items()})
        row.update(extra)
        self.rows.append(row)
        if optimizer is not None:
            self._watch(model, optimizer)

    def write(self, run, ranks) -> None:
        """Gather every rank's rows to rank 0, which writes memory.json and prints the table."""
        import torch.distributed as dist

        # What this rank really runs on, read back from the OS and torch rather than the plan.
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        mine = {"cpus": cpus, "threads": torch.get_num_threads(), "phases": self.rows}
        everyone = [mine]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        if not ranks.is_main:
            return
        doc = {"ranks": [{"rank": r, **entry} for r, entry in enumerate(everyone)]}
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
