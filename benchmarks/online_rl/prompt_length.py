"""Rollout tokens/s of sample() against model.generate() as the prompts grow: the same batch as
block `rollouts` (8 prompts × 8 generations, 48 new tokens, plain sampling, no early stop) with
every prompt 32, 128 and 512 tokens long. Writes block `rollouts_prompt_length` of
docs/benchmarks/online-rl.md.

    python benchmarks/online_rl/prompt_length.py            # ~100M in bf16 (fp32 without bf16 units): run it alone
    python benchmarks/online_rl/prompt_length.py --quick    # a tiny model, prompts of 8 and 32 tokens, one run: prints the block

A decode step's attention reads every cached position of every row. GRPO's generations of one
prompt attend to the same prompt, which the fused decoder holds and reads once for all of them
(cputrain/rollouts/paged_kv_cache.py); generate() reads a copy per row. So the longer the prompts,
the more of a step is the prompt part, and this block shows how each side's cost grows with it.
Every side runs on the malloc a `cputrain train` run uses here (rollouts.py starts itself again
on it).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.online_rl.rollouts import (  # noqa: E402
    ARCH_100M, GENERATIONS, PROMPTS, QUICK_ARCH, VOCAB_100M, alternated, build, run_generate, run_sample,
    running_allocator, start_again_with_the_runs_allocator)
from benchmarks.runner.blocks import block_parser, print_and_write_block  # noqa: E402
from benchmarks.runner.machine import machine_line, physical_cores  # noqa: E402

PROMPT_LENGTHS = (32, 128, 512)
NEW_TOKENS = 48


def same_length_batch(vocab: int, prompts: int, generations: int, length: int) -> list[list[int]]:
    """`prompts` random prompts of `length` tokens, each repeated `generations` times in a row (GRPO's layout)."""
    generator = torch.Generator().manual_seed(length)
    rows = []
    for _ in range(prompts):
        prompt = torch.randint(1, vocab, (length,), generator=generator).tolist()
        rows += [prompt] * generations
    return rows


def measure(model, rows: list[list[int]], new: int, runs: int) -> dict:
    generator = torch.Generator().manual_seed(3)
    run_sample(model, rows[:2], 2, generator)  # first calls allocate; no side is timed on them
    run_generate(model, rows[:2], 2)
    results = alternated({"ours": lambda: run_sample(model, rows, new, generator),
                          "theirs": lambda: run_generate(model, rows, new)}, runs)
    ours, theirs = results["ours"], results["theirs"]
    return {"sample": statistics.median(r["tokens_per_s"] for r in ours),
            "generate": statistics.median(r["tokens_per_s"] for r in theirs),
            "step_ms": 1e3 * statistics.median(r["decode_step_s"] for r in ours),
            "prefill_s": statistics.median(r["prefill_s"] for r in ours)}


def main() -> None:
    parser = block_parser("online-rl.md", 2, quick="tiny model, prompts of 8 and 32 tokens, one run: prints the block")
    args = parser.parse_args()
    start_again_with_the_runs_allocator()
    from cputrain.hardware import detect

    threads = physical_cores()
    torch.set_num_threads(threads)
    precision, dtype = ("bf16", torch.bfloat16) if detect().has_fast_bf16 or args.quick else ("fp32", torch.float32)
    if args.quick:
        name, arch, vocab, lengths, prompts, generations, runs = "quick", QUICK_ARCH, 512, (8, 32), 2, 2, 1
    else:
        name, arch, vocab, lengths, prompts, generations, runs = ("~100M", ARCH_100M, VOCAB_100M, PROMPT_LENGTHS,
                                                                  PROMPTS, GENERATIONS, args.runs)
    model = build(arch, vocab, dtype)
    cells = {}
    for length in lengths:
        cells[length] = measure(model, same_length_batch(vocab, prompts, generations, length), NEW_TOKENS, runs)
        print(length, {k: round(v, 3) for k, v in cells[length].items()}, flush=True)
    parameters = sum(p.numel() for p in model.parameters())
    lines = [machine_line(), "",
             f"{prompts} prompts × {generations} generations = {prompts * generations} rows, every prompt the "
             f"length of its row below, {NEW_TOKENS} new tokens, plain sampling, no early stop, {threads} thread(s), "
             f"{name} ({parameters / 1e6:.1f}M) in {precision}, every side on malloc {running_allocator()}; median of "
             f"{runs} alternated run(s) (`python benchmarks/online_rl/prompt_length.py`).", "",
             "| prompt tokens | sample() tokens/s | generate() tokens/s | × | decode ms/step | prefill s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for length, cell in cells.items():
        lines.append(f"| {length} | {cell['sample']:,.0f} | {cell['generate']:,.0f} | "
                     f"{cell['sample'] / cell['generate']:.2f}× | {cell['step_ms']:.1f} | {cell['prefill_s']:.2f} |")
    print_and_write_block("rollouts_prompt_length", "\n".join(lines), args.doc, args.quick)


if __name__ == "__main__":
    main()
