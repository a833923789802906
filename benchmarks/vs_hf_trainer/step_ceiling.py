"""The fastest a training step of a given Llama could be on this machine if everything but its
matrix products and its attention kernel took no time: the bound any trainer's tokens/s sits under.

The products are the step's own (cputrain.metrics.step_gemms: forward, input-grad and weight-grad
of every linear layer and the lm_head, every weight trained), each distinct shape timed alone in
the run's dtype with `torch.mm` into a preallocated output (fp32: float32; bf16: bfloat16, the
dtype autocast runs them in), warmed up, the median of several repeats. Attention is
`scaled_dot_product_attention` forward + backward, causal, at the step's shape, per layer. Left
out, so counted as free: norms, activations, RoPE, the loss, the optimizer, gradient accumulation
and the allocator. Measured by benchmarks/vs_hf_trainer/vs_hf_trainer.py in a process of its own.

    ceiling step s = (Σ count × time of each product + layers × attention time) × micro-batches
    ceiling tokens/s = global batch × seq_len ÷ ceiling step s
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter

import torch

from cputrain.metrics.step_gemms import step_gemms, total_flops
from cputrain.model.skeleton import parameter_counts

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIN_SAMPLE_S = 0.02  # a timed sample repeats a call until it lasts this long: small products take microseconds


def median_call_s(call, repeats: int) -> float:
    """Seconds one call takes: two untimed calls (thread pool, packing buffers, kernel choice), then
    the median of `repeats` samples."""
    call()
    t0 = time.perf_counter()
    call()
    calls_per_sample = max(1, math.ceil(MIN_SAMPLE_S / max(time.perf_counter() - t0, 1e-9)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls_per_sample):
            call()
        samples.append((time.perf_counter() - t0) / calls_per_sample)
    return statistics.median(samples)


def one_gemm_s(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    """Seconds of one [m, k] × [k, n] product."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen).to(dtype), torch.randn(k, n, generator=gen).to(dtype)
    out = torch.empty(m, n, dtype=dtype)  # written in place: the allocator is not what is timed
    return median_call_s(lambda: torch.mm(a, b, out=out), repeats)


def layer_attention_s(batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int, dtype: torch.dtype,
                      repeats: int) -> float:
    """Seconds of one layer's causal SDPA, forward and backward, on the tensors transformers hands it:
    query, key and value projected as [batch, seq, heads, head_dim] and seen transposed, key and value
    widened to every query head (repeat_kv) where the model has fewer key/value heads."""
    gen = torch.Generator().manual_seed(0)

    def projected(n_heads: int) -> torch.Tensor:
        return torch.randn(batch, seq_len, n_heads, head_dim, generator=gen).to(dtype).requires_grad_()

    def widened(t: torch.Tensor) -> torch.Tensor:
        """repeat_kv's result, made before the timing: the copy is not the kernel's work."""
        t = t.transpose(1, 2)
        return t.repeat_interleave(heads // kv_heads, dim=1) if heads > kv_heads else t

    q_leaf = projected(heads)
    q = q_leaf.transpose(1, 2)
    k, v = (widened(projected(kv_heads)).detach().requires_grad_() for _ in range(2))
    # the output's gradient arrives as transformers' attn_output.transpose(1, 2).contiguous() sends it back
    grad_out = torch.randn(batch, seq_len, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)

    def forward_backward():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q_leaf, k, v), grad_out)  # returned, not accumulated into .grad

    return median_call_s(forward_backward, repeats)


def matrix_parameters(arch: dict, vocab_size: int) -> int:
    """The transformers model's non-embedding parameters (cputrain's count: a tied lm_head included)
    less the norm weights, which are vectors and take part in no product. Built on the meta device,
    from the config as benchmarks/vs_hf_trainer/vs_hf_trainer.py builds it."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[arch["model_type"]](**{k: v for k, v in arch.items() if k != "model_type"},
                                                vocab_size=vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return parameter_counts(model)["non_embedding"] - sum(p.numel() for p in model.parameters() if p.dim() == 1)


def step_ceiling(arch: dict, vocab_size: int, micro_batch: int, global_batch: int, seq_len: int, precision: str,
                 threads: int, repeats: int = 5) -> dict:
    """The ceiling of one optimizer step of `global_batch` sequences in micro-batches of
    `micro_batch`. Seconds (gemm_s, attention_s, step_s) are per optimizer step."""
    torch.set_num_threads(threads)
    dtype = DTYPES[precision]
    micro_batches = global_batch // micro_batch
    gemms = step_gemms(arch, vocab_size, micro_batch, seq_len)
    count_per_shape = Counter()
    for g in gemms:  # q, k, v and o share a shape when the model has as many key/value heads as query heads
        count_per_shape[(g.m, g.k, g.n)] += g.count
    shapes = [{"m": m, "k": k, "n": n, "count": count, "seconds": one_gemm_s(m, k, n, dtype, repeats)}
              for (m, k, n), count in count_per_shape.items()]
    gemm_step_s = micro_batches * sum(s["count"] * s["seconds"] for s in shapes)
    heads = arch["num_attention_heads"]
    attention_step_s = micro_batches * arch["num_hidden_layers"] * layer_attention_s(
        micro_batch, heads, arch.get("num_key_value_heads") or heads, seq_len,
        arch.get("head_dim") or arch["hidden_size"] // heads, dtype, repeats)
    step_s = gemm_step_s + attention_step_s
    tokens_per_step = global_batch * seq_len
    gemm_flops_per_step = micro_batches * total_flops(gemms)
    # The check: the products listed are the model's, 6 FLOPs per matrix parameter per token.
    six_n_flops_per_step = 6 * matrix_parameters(arch, vocab_size) * tokens_per_step
    return {"ceiling_tokens_per_s": tokens_per_step / step_s, "step_s": step_s, "gemm_s": gemm_step_s,
            "attention_s": attention_step_s, "gemm_flops_per_step": gemm_flops_per_step,
            "gemm_gflops_per_s": gemm_flops_per_step / gemm_step_s / 1e9,
            "six_n_flops_per_step": six_n_flops_per_step,
            "gemm_flops_are_6n": gemm_flops_per_step == six_n_flops_per_step, "shapes": shapes}
