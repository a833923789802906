"""Which attention kernel a run uses, chosen by timing both on the run's own shape.

PyTorch's CPU flash kernel (SDPA) skips the masked half of causal attention and never holds the
T×T scores, but its backward is slow on AMX (measured on a Xeon with AMX, bf16, 2 threads:
4×12 heads×512×64 forward 8.8 ms, backward 106 ms). The eager reference does the two products
as plain bf16 matmuls on the matrix units and the softmax in fp32, holding the scores. Which one
is faster depends on the shape (at 4×12×512×64 the two were within 20%; at Llama-3-8B's
1×32×2048×128 flash took 0.29 s and eager 1.8 s), so model.attn_implementation=auto times a
forward + backward of each on the run's shape.

Timed once each, the choice flipped from run to run of the same command: at make demo-grpo's shape
(16×4 heads×256×64, fp32, a 2-core AVX2 EPYC) four runs read sdpa 46.0 / eager 55.1 ms, eager
35.1 / sdpa 47.2, eager 34.2 / sdpa 37.1 and sdpa 41.0 / eager 42.8, and the kernels' different
rounding made the runs' losses part after a few steps. So each is timed in ROUNDS alternated
rounds and its fastest kept, and eager, which holds the T×T scores where sdpa does not, is taken
only where it is faster by EAGER_MARGIN: near a tie the choice is sdpa every time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionChoice:
    implementation: str  # a transformers attn_implementation: "sdpa" or "eager"
    reason: str


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def _eager(q, k, v):
    # transformers' eager attention: keys and values repeated per query group, an additive
    # causal mask, softmax in fp32, products in the compute dtype.
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    t = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    mask = torch.full((t, t), torch.finfo(scores.dtype).min, dtype=scores.dtype).triu(1)
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return probs @ v


KERNELS = {"sdpa": _sdpa, "eager": _eager}
ROUNDS = 3  # alternated rounds of both kernels, each kernel's fastest kept
DECISIVE = 2.0  # a round where one kernel takes this many times the other's settles it (an 8B shape: 6×)
EAGER_MARGIN = 1.10  # eager only where sdpa takes ≥ 10% longer


def time_forward_backward(fn, batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int,
                          dtype: torch.dtype) -> float:
    """Seconds for one forward + backward of `fn`, after one untimed call (which pays for
    allocation and kernel set-up)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    grad = torch.ones(batch, heads, seq_len, head_dim, dtype=dtype)
    fn(q, k, v).backward(grad)
    t0 = time.perf_counter()
    fn(q, k, v).backward(grad)
    return time.perf_counter() - t0


def attention_choice(hf_config, micro_batch: int, seq_len: int, dtype: torch.dtype) -> AttentionChoice:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    shape = f"{micro_batch}×{heads} heads ({kv_heads} KV)×{seq_len}×{head_dim}, {str(dtype).removeprefix('torch.')}"
    timings: dict[str, list[float]] = {name: [] for name in KERNELS}
    with torch.autocast("cpu", enabled=False):
        for round_ in range(ROUNDS):
            for name in (KERNELS if round_ % 2 == 0 else reversed(KERNELS)):
                timings[name].append(time_forward_backward(KERNELS[name], micro_batch, heads, kv_heads, seq_len,
                                                           head_dim, dtype))
            fast, slow = sorted(min(t) for t in timings.values())
            if slow >= DECISIVE * fast:
                break
    seconds = {name: min(t) for name, t in timings.items()}
    best = "eager" if seconds["eager"] * EAGER_MARGIN <= seconds["sdpa"] else "sdpa"
    other = next(n for n in seconds if n != best)
    rounds = len(timings["sdpa"])
    reason = (f"measured forward+backward on {shape}, the fastest of {rounds} alternated round(s): "
              f"{best} {seconds[best] * 1e3:.1f} ms, {other} {seconds[other] * 1e3:.1f} ms")
    if best == "sdpa" and seconds["eager"] < seconds["sdpa"]:
        reason += (f"; eager is taken only where it is ≥ {EAGER_MARGIN - 1:.0%} faster (it holds the T×T scores, "
                   "and near a tie the choice would change from run to run)")
    return AttentionChoice(best, reason)
