"""Which malloc a training run should take: glibc as is, glibc tuned to keep what a step frees
(hardware.allocator=glibc-tuned: no mmap, no trimming, set by cputrain itself), jemalloc and
tcmalloc side by side, each `cputrain train` run at its defaults otherwise, on three models. Writes block
allocator-<precision> of docs/benchmarks/memory.md; `hardware.allocator=auto` is read from these figures
(cputrain/native/allocator.py says which).

    python benchmarks/memory/allocator.py                    # bf16 where the machine has AMX or AVX512-BF16, else fp32;
                                                      # ~20 min on 2 cores: run it alone
    python benchmarks/memory/allocator.py --precision fp32
    python benchmarks/memory/allocator.py --quick            # tiny models, 3 steps, one run: checks the script only

Needs Debian's libjemalloc2 and libtcmalloc-minimal4 (or libgoogle-perftools4); an allocator
that is not installed is left out of the table and named.

Models: the demo (`cputrain train`'s built-in model and data, from scratch); a ~100M Llama (768
wide, 12 layers, untied 8,192-token head) fully fine-tuned from a folder of bf16 safetensors; the
~300M Llama of benchmarks/lora/lora.py with LoRA r=16 on its seven projections. The ~100M run takes
4 × 2 micro-batches of 512 tokens a step, the LoRA run 4 × 1 (its steps are as long).

Every run is a fresh process (a malloc can only be preloaded into a new one) started with
`hardware.allocator=system|glibc-tuned|jemalloc|tcmalloc`; the allocators alternate within each of --runs
repetitions, so a slow spell of the machine hits each of them; medians are reported. Tokens/s: the
median per-step rate after the first warm-up steps; step peak: VmHWM reset before each step, the
highest over the steps; process peak: ru_maxrss over the whole run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.lora.lora import ARCH_300M, QUICK_ARCH, run_cputrain, spread, train_and_read  # noqa: E402
from benchmarks.runner.base_model import make_base  # noqa: E402
from benchmarks.runner.machine import physical_cores  # noqa: E402
from benchmarks.vs_hf_trainer.vs_hf_trainer import ARCH_100M  # noqa: E402

# What hardware.allocator is set to for each row, and the name the table gives it.
ALLOCATORS = {"glibc": "system", "glibc-tuned": "glibc-tuned", "jemalloc": "jemalloc", "tcmalloc": "tcmalloc"}
MODELS = ("demo", "~100M full", "~300M LoRA")


def run_model(model: str, base: str | None, allocator: str, precision: str, steps: int, warmup: int,
              seq_len: int, source: str, cache_dir: str) -> dict:
    setting = f"hardware.allocator={ALLOCATORS[allocator]}"
    if model == "demo":
        return train_and_read([f"train.max_steps={steps}", "train.log_every=1", f"train.eval_every={steps}",
                               f"train.checkpoint_every={steps}", "train.sample_tokens=0",
                               f"hardware.precision={precision}", f"data.cache_dir={cache_dir}", setting],
                              warmup, f"demo, {allocator}")
    lora = model.endswith("LoRA")
    extra = (setting, "train.global_batch_size=4") if lora else (setting,)
    return run_cputrain(base, lora, steps, warmup, seq_len, source, cache_dir, precision, extra=extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny models, 3 steps, one run; prints, writes no doc")
    ap.add_argument("--runs", type=int, default=2, help="fresh-process runs per allocator and model (default: %(default)s)")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="auto: bf16 where the machine has AMX or AVX512-BF16, else fp32")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--leave-out", nargs="+", choices=[n for n in ALLOCATORS if n != "glibc"], default=[],
                    help="allocators not to run (e.g. where one is installed but not the question)")
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench"))
    a = ap.parse_args()

    from benchmarks.runner.blocks import write_block_and_say
    from benchmarks.runner.machine import machine_line
    from cputrain.native.allocator import find_allocator
    from cputrain.hardware import detect

    hw = detect()
    precision = a.precision if a.precision != "auto" else (
        "bf16" if hw.flags.get("amx_bf16") or hw.flags.get("avx512_bf16") else "fp32")
    missing = [name for name in ("jemalloc", "tcmalloc") if find_allocator(name) is None]
    allocators = [name for name in ALLOCATORS if name not in missing and name not in a.leave_out]
    runs = 1 if a.quick else a.runs
    source = "builtin:pydoc"
    # (optimizer steps, warm-up steps left out of tokens/s) per model
    steps = {"demo": (3, 1), "~100M full": (3, 1), "~300M LoRA": (3, 1)} if a.quick else {
        "demo": (20, 3), "~100M full": (5, 1), "~300M LoRA": (5, 1)}
    seq_len = 64 if a.quick else 512
    results: dict[tuple[str, str], list[dict]] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cputrain-allocator-bench-") as tmp:
        bases: dict[str, str | None] = {"demo": None}
        for model, arch in (("~100M full", ARCH_100M), ("~300M LoRA", ARCH_300M)):
            if model in a.models:
                bases[model] = str(Path(tmp) / model.split()[0].strip("~"))
                shape = {k: v for k, v in (QUICK_ARCH if a.quick else arch).items() if k != "model_type"}
                made = make_base(Path(bases[model]), shape, source, a.cache_dir, "bfloat16")
                print(f"{model}: {made['parameters'] / 1e6:.1f}M parameters", file=sys.stderr)
        for rep in range(runs):
            for model in a.models:
                for allocator in allocators:  # alternated within each repetition
                    r = run_model(model, bases[model], allocator, precision, *steps[model], seq_len, source,
                                  a.cache_dir)
                    results.setdefault((model, allocator), []).append(r)
                    print(f"run {rep + 1}/{runs} {model} {allocator}: {r['tokens_per_s']:,.0f} tokens/s, "
                          f"step peak {r['step_peak_rss_gib']:.2f} GiB", file=sys.stderr)

    def med(model: str, allocator: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(model, allocator)])

    rows, best = [], {}
    for model in a.models:
        glibc = med(model, "glibc", "tokens_per_s")
        best[model] = max(allocators, key=lambda name: med(model, name, "tokens_per_s"))
        for allocator in allocators:
            tps = med(model, allocator, "tokens_per_s")
            rs = results[(model, allocator)]
            rows.append(f"| {model} | {allocator} | {tps:,.0f} | {spread([r['tokens_per_s'] for r in rs])} | "
                        f"{tps / glibc:.2f}× | {med(model, allocator, 'step_peak_rss_gib'):.2f} | "
                        f"{med(model, allocator, 'process_peak_rss_gib'):.2f} |")
    first = results[(a.models[-1], "glibc")][-1]
    markdown = "\n".join([
        f"### Which malloc, {precision}: glibc as is and tuned, jemalloc and tcmalloc under `cputrain train`",
        "",
        machine_line(),
        "",
        f"`python benchmarks/memory/allocator.py{' --precision ' + precision if a.precision != 'auto' else ''}`: "
        f"{__doc__.split(chr(10) + chr(10))[3].strip()} Precision {first['precision']}, {physical_cores()} "
        f"threads; {', '.join(f'{m} {s} steps ({w} warm-up)' for m, (s, w) in steps.items() if m in a.models)}; "
        f"median of {runs} alternated fresh-process run(s)."
        + (f" Not installed, so not measured: {', '.join(missing)}." if missing else "")
        + (f" Left out of this run: {', '.join(a.leave_out)}." if a.leave_out else ""),
        "",
        "| model | malloc | tokens/s | range | vs glibc | step peak RSS (GiB) | process peak RSS (GiB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "Fastest: " + "; ".join(f"{m}: {b}" for m, b in best.items())
        + f". Wall time of the benchmark: {(time.perf_counter() - t_start) / 60:.0f} min.",
    ])
    print(markdown)
    if not a.quick:
        write_block_and_say(f"allocator-{precision}", markdown)


if __name__ == "__main__":
    main()
