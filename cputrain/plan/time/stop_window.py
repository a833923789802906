"""How long a run needs to stop cleanly after a SIGTERM: finish the step it is in, then write a
checkpoint. `cputrain k8s` sets the pods' terminationGracePeriodSeconds and the agent's
launch.stop_timeout_s from it, so a node drain never kills a save half-way (the kubelet's
default grace period is 30 s; one step of an 8B model is minutes).

    stop window = one step at an assumed fraction of the instance's peak FLOP/s
                + the whole checkpoint's bytes at the storage's write rate
    grace period = stop window + a margin for the agent's own exit

Every rank writes its shards at once to the same shared file system (FSx for Lustre: its
throughput is the file system's, shared by all clients), so a save takes the checkpoint's total
bytes over that rate, whatever the number of ranks. Both assumptions are stated so a user can
correct them: `--storage-write-mib-s`, or `--grace-period-s` to set the period outright.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cputrain.config import checkpointed_blocks
from cputrain.hardware import peak_flops
from cputrain.metrics.flops import flops_per_token
from cputrain.plan.memory.accounting import BYTES_PER_PARAM
from cputrain.plan.instances import Instance
from cputrain.plan.model_shape import ModelShape

# FSx for Lustre's smallest file system (1.2 TiB, SCRATCH_2) has a baseline of 200 MB/s per TiB,
# 240 MB/s; 200 MiB/s stays below it. Other storage: pass its rate.
DEFAULT_STORAGE_WRITE_MIB_S = 200.0
# A step's share of the theoretical peak, on the low side on purpose: a step estimated too long
# only keeps a pod a little longer, one estimated too short kills the save it waited for.
# (AMX bf16 steps measure 20-40% of the tile peak; fp32 steps ~40% of the FMA peak.)
ASSUMED_MFU = 0.10
# Sapphire Rapids' all-core turbo on c7i/m7i/r7i; the per-cycle rates come from cputrain.hardware.
ASSUMED_CLOCK_GHZ = 3.2
# The agent's exit after its ranks have saved: closing the rendezvous, the last log lines.
EXIT_MARGIN_S = 30
# A spot instance gets two minutes' notice before it is reclaimed, whatever the grace period.
SPOT_NOTICE_S = 120


@dataclass(frozen=True)
class StopWindow:
    step_s: float
    checkpoint_bytes: int
    save_s: float
    storage_write_mib_s: float

    @property
    def stop_timeout_s(self) -> int:
        """What the agent gives its ranks after forwarding the signal (launch.stop_timeout_s)."""
        return max(1, math.ceil(self.step_s + self.save_s))

    @property
    def grace_period_s(self) -> int:
        return self.stop_timeout_s + EXIT_MARGIN_S

    def describe(self) -> str:
        return (f"stop window {self.stop_timeout_s} s: one step ~{self.step_s:,.0f} s (at {ASSUMED_MFU:.0%} of the "
                f"instance's peak) + a {self.checkpoint_bytes / 2**30:,.1f} GiB checkpoint at "
                f"{self.storage_write_mib_s:g} MiB/s ~{self.save_s:,.0f} s, then {EXIT_MARGIN_S} s for the agent's exit")


def checkpoint_bytes(shape: ModelShape, strategy: str, precision: str) -> int:
    """Bytes of one checkpoint across all ranks: each trained parameter as stored plus its optimizer
    state (frozen weights are never saved; DCP writes a replicated tensor once)."""
    p_bytes, _, k_bytes = BYTES_PER_PARAM[(strategy, precision)]
    return shape.trainable_params * (p_bytes + k_bytes)


def step_flops(shape: ModelShape, seq_len: int, global_batch: int,
               activation_checkpointing: bool | int | str) -> float:
    """Model FLOPs of one optimizer step, counted as cputrain.metrics.flops counts them."""
    embeddings = [p for p in shape.params if "embed_tokens" in p.name]
    # The input table is a lookup, not a matmul; a tied lm_head still multiplies by it.
    untied = 0 if shape.tied_embeddings else sum(p.numel for p in embeddings)
    non_embedding = shape.total_params - untied
    trained = shape.trainable_params - (0 if shape.tied_embeddings else sum(p.numel for p in embeddings if p.trainable))
    per_token = flops_per_token(non_embedding, shape.layers, shape.hidden, seq_len, trained_params=trained)
    # the forward of each block checkpointed whole runs again in the backward; selective blocks
    # run no matmul again (only norms, RoPE, SiLU × up and LoRA's thin lora_B: no count here)
    per_token += 2 * non_embedding * checkpointed_blocks(activation_checkpointing, shape.layers) / shape.layers
    return per_token * seq_len * global_batch


def instance_peak_flops(instance: Instance, precision: str) -> float:
    """The instance's theoretical peak: AVX-512 with two FMA pipes on every built-in family, AMX
    where the table says so."""
    flags = {"avx512f": True, "fma": True, "amx_bf16": instance.amx}
    return peak_flops(flags, instance.physical_cores, ASSUMED_CLOCK_GHZ)[0][precision]


def stop_window(shape: ModelShape, strategy: str, precision: str, seq_len: int, global_batch: int,
                activation_checkpointing: bool | int | str, instance: Instance, nnodes: int,
                storage_write_mib_s: float = DEFAULT_STORAGE_WRITE_MIB_S) -> StopWindow:
    flops = step_flops(shape, seq_len, global_batch, activation_checkpointing)
    step_s = flops / (instance_peak_flops(instance, precision) * nnodes * ASSUMED_MFU)
    ckpt = checkpoint_bytes(shape, strategy, precision)
    return StopWindow(step_s=step_s, checkpoint_bytes=ckpt, save_s=ckpt / (storage_write_mib_s * 2**20),
                      storage_write_mib_s=storage_write_mib_s)
