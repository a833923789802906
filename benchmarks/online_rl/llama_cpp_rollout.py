"""llama.cpp as the rollout's decoder, weighed: its batched decode (llama_cpp_decode.py, sampling
still cputrain's) against cputrain's sample() and transformers' generate() at the same batch,
prompts and length, and what handing it new weights would cost each step. Writes block
`llama_cpp_rollout` of docs/benchmarks/online-rl.md.

    scripts/install.sh llama-cpp-peer                        # builds llama.cpp (~4 min on 2 cores)
    python benchmarks/online_rl/llama_cpp_rollout.py         # demo size and ~100M: run it alone
    python benchmarks/online_rl/llama_cpp_rollout.py --quick # a tiny model, one run: prints the block only

The batch and models are the rollouts benchmark's (rollouts.py): 8 prompts × 8 generations, prompts
of 16–48 random tokens, 48 new tokens, plain sampling, no early stop, random weights, the demo's shape
and ~100M. Each model is saved with a byte-level BPE of its vocabulary (GGUF carries one;
benchmarks/runner/base_model.py) and exported by `cputrain export --gguf`'s writer: f32, and bf16
where the CPU has bf16 units. A cell is one precision: llama.cpp on that GGUF, sample() and generate() on the model held in that dtype,
alternated --runs times (the order reversed each run), the median of each.

The weight sync is what a run would pay before each rollout, since the policy changes every step:
the GGUF export (from the saved folder, its loading included: an upper bound) and llama.cpp's load.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.online_rl.rollouts import (  # noqa: E402
    ARCH_100M, GENERATIONS, PROMPTS, QUICK_ARCH, VOCAB_100M, batch, demo_shape, run_generate, run_sample)
from benchmarks.runner.blocks import block_parser, command_as_run, print_and_write_block  # noqa: E402
from benchmarks.runner.machine import machine_line, physical_cores  # noqa: E402

NEW_TOKENS = 48
GGUF_TYPE = {"fp32": "f32", "bf16": "bf16"}


def loaded(folder: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # no row stops early: every row writes the same length
    model.generation_config.pad_token_id = 0
    return model


def measure_cell(folder: Path, precision: str, rows: list[list[int]], new: int, runs: int, threads: int) -> dict:
    from benchmarks.online_rl.llama_cpp_decode import LlamaCppModel
    from cputrain.finished.gguf.write import export_gguf

    gguf = folder.parent / f"{folder.name}-{precision}.gguf"
    gguf.unlink(missing_ok=True)
    started = time.perf_counter()
    export_gguf(folder, GGUF_TYPE[precision], gguf)
    export_s = time.perf_counter() - started
    started = time.perf_counter()
    theirs_cpp = LlamaCppModel(str(gguf), threads)
    load_s = time.perf_counter() - started
    model = loaded(folder, torch.float32 if precision == "fp32" else torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    theirs_cpp.rollout(rows[:2], 2, generator)  # first calls allocate; no side is timed on them
    run_sample(model, rows[:2], 2, generator)
    run_generate(model, rows[:2], 2)
    cpp, ours, generate = [], [], []
    for run in range(runs):
        sides = [lambda: cpp.append(theirs_cpp.rollout(rows, new, generator)),
                 lambda: ours.append(run_sample(model, rows, new, generator)),
                 lambda: generate.append(run_generate(model, rows, new))]
        for call in sides if run % 2 == 0 else reversed(sides):
            call()
    theirs_cpp.close()
    return {"llama_cpp": statistics.median(r["tokens_per_s"] for r in cpp),
            "llama_cpp_step_ms": 1e3 * statistics.median(r["decode_step_s"] for r in cpp),
            "llama_decode_share": statistics.median(r["decode_call_share"] for r in cpp),
            "sample": statistics.median(r["tokens_per_s"] for r in ours),
            "sample_step_ms": 1e3 * statistics.median(r["decode_step_s"] for r in ours),
            "generate": statistics.median(r["tokens_per_s"] for r in generate),
            "export_s": export_s, "load_s": load_s,
            "rollout_s": len(rows) * new / statistics.median(r["tokens_per_s"] for r in cpp),
            "parameters": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = block_parser("online-rl.md", 5)
    args = parser.parse_args()
    from benchmarks.runner.base_model import make_base
    from cputrain.hardware import detect

    threads = physical_cores()
    torch.set_num_threads(threads)
    precisions = ["fp32", "bf16"] if detect().has_fast_bf16 or args.quick else ["fp32"]
    if args.quick:
        sizes, prompts, generations, new, runs = {"quick": (QUICK_ARCH, 512)}, 2, 2, 8, 1
    else:
        sizes = {"demo": demo_shape(), "~100M": (ARCH_100M, VOCAB_100M)}
        prompts, generations, new, runs = PROMPTS, GENERATIONS, NEW_TOKENS, args.runs
    cells = {}
    with tempfile.TemporaryDirectory(prefix="cputrain-llama-cpp-") as tmp:
        for size, (arch, vocab) in sizes.items():
            folder = Path(tmp) / size.strip("~")
            vocab = make_base(folder, arch, "builtin:pydoc", str(Path(tmp) / "cache"), "float32", vocab)["vocab"]
            rows = batch(vocab, prompts, generations)
            for precision in precisions:
                cells[size, precision] = measure_cell(folder, precision, rows, new, runs, threads)
                print(size, precision, {k: round(v, 3) for k, v in cells[size, precision].items()}, flush=True)
    block = "\n".join(render(cells, threads, prompts, generations, new, runs))
    print_and_write_block("llama_cpp_rollout", block, args.doc, args.quick)


def render(cells: dict, threads: int, prompts: int, generations: int, new: int, runs: int) -> list[str]:
    import llama_cpp

    lines = [machine_line().rstrip(".") + f"; llama-cpp-python {llama_cpp.__version__}.", "",
             f"{prompts} prompts × {generations} generations = {prompts * generations} rows, {new} new tokens, "
             f"plain sampling (cputrain's draw on every side but generate()), no early stop, {threads} thread(s); "
             f"median of {runs} alternated runs per cell (`{command_as_run()}`). llama.cpp: the GGUF of the "
             "cell's precision, one sequence and KV stream a row, the step's time with the sampling, and "
             "llama_decode's share of it. Sync: the GGUF export and llama.cpp's load, once per rollout where the "
             "weights change every step, against the rollout's own time on llama.cpp.", "",
             "| model | precision | llama.cpp tokens/s | sample() tokens/s | generate() tokens/s | llama.cpp ÷ sample() | "
             "step ms (llama.cpp, sample()) | llama_decode share | sync s (export + load) | sync ÷ rollout |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (size, precision), c in cells.items():
        sync_s = c["export_s"] + c["load_s"]
        lines.append(
            f"| {size} ({c['parameters'] / 1e6:.1f}M) | {precision} | {c['llama_cpp']:,.0f} | {c['sample']:,.0f} | "
            f"{c['generate']:,.0f} | {c['llama_cpp'] / c['sample']:.2f}× | {c['llama_cpp_step_ms']:.1f}, "
            f"{c['sample_step_ms']:.1f} | {c['llama_decode_share']:.0%} | {sync_s:.2f} ({c['export_s']:.2f} + "
            f"{c['load_s']:.2f}) | {sync_s / c['rollout_s']:.0%} |")
    return lines


if __name__ == "__main__":
    main()
