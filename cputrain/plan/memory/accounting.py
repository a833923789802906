"""Bytes of parameters, gradients and optimizer state one rank holds: the ZeRO accounting.

The published accounting (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", 2020, §3 and §5) counts, per parameter Ψ, with N ranks:

    stage          params   grads    optimizer (Adam)     per rank
    0 (DDP)        P        G        K                    (P + G + K)·Ψ
    3 (FSDP/ZeRO3) P/N      G/N      K/N                  (P + G + K)·Ψ / N

cputrain keeps fp32 master weights and runs bf16 only as autocast compute, so with AdamW
P = 4 (fp32 weights), G = 4 (fp32 gradients), K = 8 (two fp32 moments): 16 bytes/param in
both precisions. DeepSpeed ZeRO-3 keeps the model's own copy (fp32, or bf16 when its bf16 mode
is on) and separately an fp32 master copy, so K = 12 there: 20 bytes/param in fp32 and 16 in
bf16 (2 + 2 + 12, the paper's mixed-precision figure).

"Per rank ÷ N" is the idea; the exact bytes come from how each library splits a tensor, and
memory.json is compared against these exactly:

- FSDP2 (`fully_shard`) splits every parameter along dim 0 like `torch.chunk`: rank r owns
  rows [r·c, min((r+1)·c, d0)) with c = ceil(d0 / N), but every rank's parameter storage, and
  the reduce-scatter output its gradients live in, is padded to c rows (dim 0 padded to a
  multiple of N). AdamW's moments are `zeros_like` the local shard: unpadded rows only.
- DeepSpeed ZeRO-3 flattens each parameter, pads it to a multiple of N and gives every rank
  ceil(numel / N) elements.
- DeepSpeed ZeRO-3 keeps a parameter with at most `stage3_param_persistence_threshold`
  elements (norm gains, biases) gathered after its first use: at N > 1 ranks each of these
  holds its whole tensor beside its partition (at N = 1 the partition is the tensor).
- AdamW keeps `exp_avg` and `exp_avg_sq` shaped like the (local) parameter, plus one 4-byte
  `step` scalar tensor per parameter.

LoRA (model.lora) trains only the adapters: they get the accounting above, and every other
parameter is frozen: its stored bytes (2 in bf16, 4 in fp32) and nothing else, no gradient,
no optimizer state, no fp32 master. FSDP2 shards a frozen parameter like any other (padded
dim 0, in its own dtype); DDP's buckets hold the adapters' gradients only. zero3 takes no LoRA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cputrain.plan.model_shape import ModelShape

FP32_BYTES = 4
BF16_BYTES = 2
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq
ADAM_STEP_BYTES = 4  # torch.optim.AdamW keeps `step` as a float32 scalar tensor per parameter

# bytes per parameter (P, G, K) for each strategy and precision, as in the table above
BYTES_PER_PARAM = {
    ("single", "fp32"): (4, 4, 8),
    ("single", "bf16"): (4, 4, 8),
    ("ddp", "fp32"): (4, 4, 8),
    ("ddp", "bf16"): (4, 4, 8),
    ("fsdp", "fp32"): (4, 4, 8),
    ("fsdp", "bf16"): (4, 4, 8),
    ("zero3", "fp32"): (4, 4, 12),
    ("zero3", "bf16"): (2, 2, 12),
}
SHARDED = {"single": False, "ddp": False, "fsdp": True, "zero3": True}


@dataclass(frozen=True)
class StateBytes:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    local_params: int  # elements of trained parameters this rank holds (frozen ones add only their bytes)


def fsdp_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows of a dim-0 `torch.chunk` split that rank `rank` holds (trailing ranks may hold none)."""
    chunk = math.ceil(dim0 / world_size)
    return max(0, min(chunk, dim0 - rank * chunk))


def local_numel(shape: tuple[int, ...], strategy: str, world_size: int, rank: int, padded: bool = True) -> int:
    """Elements of one parameter's local piece; `padded` counts FSDP2's padded storage."""
    numel = math.prod(shape)
    if strategy == "fsdp" and shape:
        rows = math.ceil(shape[0] / world_size) if padded else fsdp_rows(shape[0], world_size, rank)
        return rows * (numel // shape[0] if shape[0] else 0)
    if strategy == "zero3" and world_size > 1:
        return math.ceil(numel / world_size)  # padded to a multiple of N, then split evenly
    return numel


def persistent_numel(shape: ModelShape, world_size: int, persistence_threshold: int) -> int:
    """Elements of the small parameters ZeRO-3 keeps whole on every rank besides their partitions."""
    if world_size == 1:
        return 0
    return sum(p.numel for p in shape.params if p.numel <= persistence_threshold)


def state_bytes(shape: ModelShape, strategy: str, precision: str, world_size: int, rank: int = 0,
                persistence_threshold: int = 0, offload_optimizer: bool = False) -> StateBytes:
    """Exact bytes of parameters, gradients and optimizer state held by `rank`."""
    p_bytes, g_bytes, k_bytes = BYTES_PER_PARAM[(strategy, precision)]
    ws = world_size if SHARDED[strategy] else 1
    trained = [p for p in shape.params if p.trainable]
    frozen = [p for p in shape.params if not p.trainable]
    local = sum(local_numel(p.shape, strategy, ws, rank) for p in trained)
    frozen_bytes = sum(local_numel(p.shape, strategy, ws, rank) * p.stored_bytes for p in frozen)
    if strategy == "zero3":
        if frozen:
            raise ValueError("zero3 is not planned with frozen parameters: cputrain refuses model.lora with zero3")
        # DeepSpeed hands the optimizer one flat fp32 partition per parameter group (cputrain's
        # two: matrices with weight decay, vectors without; sub_group_size 1e9 keeps each whole),
        # so torch's AdamW keeps one `step` scalar per group; DeepSpeedCPUAdam (offload) keeps
        # its step count as a Python int.
        persistent = persistent_numel(shape, ws, persistence_threshold)
        groups = 0 if offload_optimizer else len({len(p.shape) >= 2 for p in shape.params})
        return StateBytes(param_bytes=(local + persistent) * p_bytes, grad_bytes=local * g_bytes,
                          optimizer_bytes=local * k_bytes + groups * ADAM_STEP_BYTES, local_params=local)
    owned = sum(local_numel(p.shape, strategy, ws, rank, padded=False) for p in trained)
    optimizer = owned * ADAM_MOMENTS * FP32_BYTES + len(trained) * ADAM_STEP_BYTES
    return StateBytes(param_bytes=local * p_bytes + frozen_bytes, grad_bytes=local * g_bytes,
                      optimizer_bytes=optimizer, local_params=local)
