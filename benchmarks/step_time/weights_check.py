"""What the per-step weights check costs: the trainer reads every trained parameter once after
each optimizer step (Strategy.weights_finite: the sum of the trained tensors' sums, finite or not)
so that an update that leaves inf or nan in the weights is a bad step, never a checkpoint or an
export. Two other full reads are timed beside it: a fused max-|x| norm and isfinite().all().
Writes block weights-check of docs/benchmarks/step-time.md.

    python benchmarks/step_time/weights_check.py            # demo shape and ~100M, fp32 and bf16 where the CPU has it
    python benchmarks/step_time/weights_check.py --quick    # the demo shape only, fewer repetitions

The step is the trainer's: forward with labels and backward over micro-batches (bf16 under one
autocast region, as cputrain runs it), clip, AdamW; the check runs on the same model right after.
Both are timed in one process, alternated, median of the repetitions: the ratio check ÷ step is
the share of a step the check costs (target ≤ 1%).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.blocks import write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402

SHAPES = {
    # the demo's model (configs/demo.yaml's arch, cputrain's default)
    "demo (~5M)": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=4096, tie_word_embeddings=True, seq_len=256, micro_batch=4),
    "~100M": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, vocab_size=8192, tie_word_embeddings=False, seq_len=512, micro_batch=4),
}


def measure(shape: dict, precision: str, repeats: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cputrain.config import TrainConfig
    from cputrain.parallel.adamw import build_adamw
    from cputrain.parallel.base import all_finite

    torch.manual_seed(0)
    arch = {k: v for k, v in shape.items() if k not in ("seq_len", "micro_batch")}
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=shape["seq_len"], **arch))
    params = sum(p.numel() for p in model.parameters())
    optimizer = build_adamw(model, TrainConfig(lr=1e-4))
    ids = torch.randint(0, arch["vocab_size"], (shape["micro_batch"], shape["seq_len"]))
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext())

    def step() -> None:
        with autocast:
            for _ in range(2):  # two micro-batches, as an accumulating step
                model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    trained = [p.detach() for p in model.parameters() if p.requires_grad]
    checks = {
        "sum": lambda: all_finite(trained),  # what the trainer runs
        "max-|x|": lambda: bool(torch.isfinite(torch.stack(torch._foreach_norm(trained, float("inf")))).all()),
        "isfinite": lambda: all(bool(t.isfinite().all()) for t in trained),
    }
    step()  # warm-up: allocator, AdamW state
    step_s, check_s = [], {name: [] for name in checks}
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        step_s.append(time.perf_counter() - t0)
        for name, check in checks.items():
            t0 = time.perf_counter()
            assert check()
            check_s[name].append(time.perf_counter() - t0)
    step_med = statistics.median(step_s)
    check_med = {name: statistics.median(times) for name, times in check_s.items()}
    return {"params": params, "step_s": step_med, "check_s": check_med, "share": check_med["sum"] / step_med}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the demo shape only, 3 repetitions")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    import torch

    from cputrain.hardware import detect

    hw = detect()
    torch.set_num_threads(hw.physical_cores)
    precisions = ["fp32"] + (["bf16"] if hw.flags.get("amx_bf16") or hw.flags.get("avx512_bf16") else [])
    shapes = {k: v for k, v in SHAPES.items() if not args.quick or k.startswith("demo")}
    repeats = 3 if args.quick else args.repeats
    rows = []
    for name, shape in shapes.items():
        for precision in precisions:
            r = measure(shape, precision, repeats)
            c = r["check_s"]
            rows.append(f"| {name} | {r['params'] / 1e6:.1f}M | {precision} | {r['step_s'] * 1e3:,.1f} | "
                        f"{c['sum'] * 1e3:.2f} | {100 * r['share']:.2f}% | {c['max-|x|'] * 1e3:.2f} | "
                        f"{c['isfinite'] * 1e3:.2f} |")
            print(rows[-1], flush=True)
    if args.quick:
        return
    write_block("weights-check", "\n".join([
        "## The per-step weights check",
        "",
        machine_line(),
        "",
        f"`python benchmarks/step_time/weights_check.py`: a training step (2 micro-batches, clip, AdamW; bf16 under one "
        f"autocast region) and the check the trainer runs after it (`Strategy.weights_finite`: the sum of the "
        f"trained tensors' sums is finite), alternated in one process, median of {repeats}; "
        f"{hw.physical_cores} threads. Target: ≤ 1% of a step. Beside it, two other full reads of the same "
        f"tensors that were tried: a fused max-\\|x\\| norm (`torch._foreach_norm(…, inf)`) and "
        f"`isfinite().all()` per tensor.",
        "",
        "| model | parameters | precision | step (ms) | check: sum (ms) | check ÷ step | max-\\|x\\| (ms) | "
        "isfinite (ms) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "On several ranks the check adds one all-reduce of one number per step (each rank reads its own shard).",
    ]))


if __name__ == "__main__":
    main()
