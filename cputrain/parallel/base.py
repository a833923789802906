"""The protocol every strategy offers the trainer; the trainer never branches on a strategy name.

Build order (see trainer.setup): wrap(skeleton) → load_weights → (the converter fills its
adapters) → check_weights → build_optimizer. Wrapping
comes before any weight exists so that a sharding strategy materializes only its own shard.
Code that every strategy shares lives beside the protocol, not in a strategy: the meter
(distributed.comm), weight-decay groups (optim.decay_groups), reading rows of a safetensors
file into whatever a rank holds (model.load_into with a copy_fn).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from cputrain.config import Config
from cputrain.distributed.comm import NO_METER, CommMeter

if TYPE_CHECKING:
    from cputrain.run_folder.dcp_state import CheckpointState


log = logging.getLogger("cputrain")


def ignored_settings(strategy: "Strategy", cfg: Config) -> list[str]:
    """Settings this strategy has no use for, each with the reason (a warning, not an error)."""
    lines = []
    if not strategy.supports_offload:
        for key in ("offload_optimizer", "offload_param"):
            if getattr(cfg.parallel, key):
                lines.append(f"parallel.{key}=true is ignored: strategy {strategy.name} has no offload "
                             "(on a CPU host its state is already in host memory; only zero3 offloads, through DeepSpeed)")
    if cfg.parallel.deepspeed_config and strategy.name != "zero3":
        lines.append(f"parallel.deepspeed_config is ignored: it configures strategy zero3, not {strategy.name}")
    return lines


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """No inf or nan in any of `tensors`: the sum of their sums is finite (nan and ±inf propagate
    through a sum). A sum is the cheapest full read torch has: 9 ms for 88M fp32 weights on 2
    cores, where a max-|x| norm took 115 ms and isfinite().all() 112 ms (benchmarks/weights_check.py).
    A sum of finite values overflows fp32 only for weights near 1e30 and more, unusable anyway."""
    tensors = [t for t in tensors if t.numel()]
    return not tensors or bool(torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum()))


@dataclass
class StrategyContext:
    """What a strategy is built from. The compute dtype is read from here, never from the
    config's precision string: one value, decided once (cputrain.config.resolve)."""

    cfg: Config
    rank: int
    world_size: int
    compute_dtype: torch.dtype
    # The model converter's map from a parameter to its name in the base's files (None: not there).
    file_name_of: Callable[[str], str | None] = lambda name: name
    ranks_per_node: int = 1  # ranks on each node (a layout that keeps traffic inside a node reads it)


class Strategy:
    """One meaning per method. Build: wrap, load_weights, check_weights, build_optimizer. Step: autocast,
    accumulation, backward, step. State: checkpoint_state (what a checkpoint saves and loads),
    full_state_dict (what the export writes), tensors_held (what the memory report counts).
    `meter` is the communication meter (no-op where nothing is metered). Strategies write no
    files: the checkpoint object (cputrain.run_folder.checkpoints) does."""

    name = "base"
    supports_offload = False  # keeps optimizer state / parameters in host memory on request (zero3)
    metered = False  # collectives are timed and counted (ddp, fsdp: the trainer logs comm_* fields)

    def __init__(self, ctx: StrategyContext):
        self.ctx = ctx
        self.meter = CommMeter.install() if self.metered else NO_METER
        if ctx.rank == 0:
            for line in ignored_settings(self, ctx.cfg):
                log.warning("warning: %s", line)

    # --- build ---------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """Wrap the model skeleton (possibly on meta). Return what the trainer calls forward on."""
        return model

    def load_weights(self, model: nn.Module, folder: Path | None) -> None:
        """Materialise and fill the wrapped model: from `folder`'s safetensors, or random init
        from the config's seed."""
        raise NotImplementedError

    def check_weights(self, model: nn.Module) -> None:
        """Called once every weight is in place (the files, then the converter's adapters): what the
        strategy verifies before the first step. Nothing by default; ddp checks that its replicas agree."""

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        from cputrain.parallel.adamw import build_adamw

        return build_adamw(model, self.ctx.cfg.train)

    # --- step ----------------------------------------------------------------------------
    def autocast(self):
        """Context for forward passes: bf16 autocast unless the strategy casts parameters itself."""
        if self.ctx.compute_dtype == torch.bfloat16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def accumulation(self, model: nn.Module, last_micro_batch: bool):
        """Context around forward+backward of one micro-batch (DDP skips its all-reduce unless last)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    # Whether step() can leave the weights untouched when the gradients are not finite, and what
    # a bad step's warning says in place of "optimizer step skipped" where it cannot.
    can_skip_step = True
    # Whether zero_grad drops the gradients (set_to_none) or zeroes them in place: a strategy whose
    # gradients are views of its own buffers may keep them (DDP's buckets: cputrain.parallel.ddp).
    grads_to_none = True
    cannot_skip_words = "this strategy cannot skip it"

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
             loss_finite: bool = True) -> tuple[float, bool]:
        """Clip, step, zero the gradients. Returns the global gradient norm before clipping and
        whether the optimizer stepped: it does not when the loss (every rank's, agreed by the
        caller) or the norm is not finite, so NaN never reaches a weight or an AdamW moment.
        The norm is global (the same on every rank), so all ranks skip or step together."""
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        stepped = loss_finite and math.isfinite(norm)
        if stepped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=self.grads_to_none)
        return norm, stepped

    def weights_finite_on_every_rank(self, model: nn.Module) -> bool:
        """Each rank reads the trained weights it holds (weights_finite); one all-reduce of one
        number on several ranks, so every rank answers alike."""
        from cputrain.distributed import process_group as pg

        finite_here = self.weights_finite(model)
        (bad_ranks,) = pg.all_reduce_sum([0.0 if finite_here else 1.0])
        return bad_ranks == 0

    def weights_finite(self, model: nn.Module) -> bool:
        """Whether every trained parameter this rank holds (its shard, where sharded) is finite. A
        step whose loss and gradient norm are finite can still leave weights at inf or nan (a far
        too high lr). One read of the trained weights, no copy of them (all_finite)."""
        return all_finite([p.to_local() if hasattr(p, "to_local") else p for p in model.parameters() if p.requires_grad])

    # --- state ---------------------------------------------------------------------------
    def checkpoint_state(self, model: nn.Module, optimizer) -> CheckpointState:
        """Model and optimizer state, which the checkpoint object saves to and loads from a step folder."""
        from cputrain.run_folder.dcp_state import DCPState

        return DCPState(model, optimizer)

    def full_state_dict(self, model: nn.Module, keep: Callable[[str], bool] = lambda name: True
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) pairs, one tensor at a time, for the HF export (rank 0 writes them);
        only names `keep` accepts are gathered (a LoRA export gathers the adapters alone)."""
        for name, tensor in self.unwrap(model).state_dict().items():
            if keep(name):
                yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

    def tensors_held(self, model: nn.Module) -> tuple[list, list, list]:
        """(parameter, gradient, master) tensors this rank holds, for the memory report."""
        params = list(model.parameters())
        return params, [p.grad for p in params], []

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The Hugging Face module inside the wrapper (compile and the export name its blocks)."""
        return model

    def close(self) -> None:
        self.meter.uninstall()
