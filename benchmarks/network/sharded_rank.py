"""A sharded rank against the same rank unsharded: one rank alone, nothing to communicate.

What FSDP2 and ZeRO-3 cost a rank on their own (their casts, copies, hooks, allocations), measured
as the step time of one rank under `single`, `fsdp` (per layout) and `zero3` at three sizes (the
demo's ~4M, ~34M, ~100M) in bf16 (where the CPU has bf16 units) and fp32, alternated round by
round, median step of the steps after the first two. Each case runs on each of the two allocators
`auto` can give it: tcmalloc where installed (preloaded, as the training image has it), and
without it glibc (tuned, keeping what a step frees, for single; as is, its mmap threshold pinned,
for fsdp and zero3). A sharded case is divided by the single case on the same allocator. One run
per case of the sizes in --profile-sizes is profiled (`train.profile_step`) for the step's time by
operator family. Writes block `sharded_rank` of docs/benchmarks/network.md; the time plan reads the
factors from cputrain/plan/time/sharded_compute.py, which cites this block.

    python benchmarks/network/sharded_rank.py                  # the figures (a quiet machine)
    python benchmarks/network/sharded_rank.py --sizes 34m --precisions bf16 --rounds 3
    python benchmarks/network/sharded_rank.py --tcmalloc /path/to/libtcmalloc_minimal.so.4
    python benchmarks/network/sharded_rank.py --precisions fp32 --allocators tcmalloc --block sharded_rank_fp32
    python benchmarks/network/sharded_rank.py --precisions bf16 --allocators tcmalloc --rounds 3 --block sharded_rank_bf16
    python benchmarks/network/sharded_rank.py --quick          # tiny model, 3 steps: checks the script only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.network.model_sizes import MODEL_34M, MODEL_TINY  # noqa: E402
from benchmarks.runner.blocks import command_as_run, print_and_write_block  # noqa: E402
from benchmarks.runner.cputrain_run import train_measured  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402

MODEL_100M = ["model.arch.hidden_size=768", "model.arch.intermediate_size=2048", "model.arch.num_hidden_layers=12",
              "model.arch.num_attention_heads=12", "model.arch.num_key_value_heads=12",
              "model.tokenizer_vocab_size=16384"]
SIZES = {"demo": [], "34m": MODEL_34M, "100m": MODEL_100M}  # the demo: configs/demo.yaml's own model
# (label, overrides, allocator): each case on glibc (what `auto` gives it without tcmalloc) and on
# tcmalloc; a sharded case is divided by the single case of the same allocator. gather_once on glibc
# is left out (1.41× at ~34M in bf16, its last measurement: network.md's text beside the block).
SINGLE = ["parallel.strategy=single"]
FULL_SHARD = ["parallel.strategy=fsdp", "parallel.layout=full_shard"]
GATHER_ONCE = ["parallel.strategy=fsdp", "parallel.layout=gather_once"]
ZERO3 = ["parallel.strategy=zero3"]
CASES = [
    ("single, glibc tuned", SINGLE, "glibc-tuned"),
    ("fsdp full_shard, glibc", FULL_SHARD, "system"),
    ("zero3, glibc", ZERO3, "system"),
    ("single, tcmalloc", SINGLE, "tcmalloc"),
    ("fsdp full_shard, tcmalloc", FULL_SHARD, "tcmalloc"),
    ("fsdp gather_once, tcmalloc", GATHER_ONCE, "tcmalloc"),
    ("zero3, tcmalloc", ZERO3, "tcmalloc"),
]
SINGLE_OF = {"glibc-tuned": "single, glibc tuned", "system": "single, glibc tuned", "tcmalloc": "single, tcmalloc"}
FAMILIES = ("matmul", "attention", "compiled", "casts_copies", "elementwise", "cross_entropy", "optimizer", "python",
            "other", "collectives")


TOKENS_PER_STEP = 8 * 512  # common(): global batch 8 of seq 512


def common(steps: int, cache: Path) -> list[str]:
    # log_every=1: a row per step, so the median below is of steps, not of rows that average a
    # window with the first step in it (a run's first step times its kernels and warms its heap)
    return [f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=1000", "train.checkpoint_every=1000",
            "train.sample_tokens=0", "data.seq_len=512", "train.global_batch_size=8", "train.micro_batch_size=2",
            f"data.cache_dir={cache}", "model.attn_implementation=sdpa"]


def median_step_s(rows: list[dict]) -> float:
    return statistics.median(r["step_time_s"] for r in rows if r.get("step_time_s") and r["step"] > 2)


def profiled(overrides: list[str], step: int) -> dict[str, float]:
    """The profiled step's seconds by operator family (train.profile_step, rank 0's profile file)."""
    with tempfile.TemporaryDirectory(prefix="sharded-rank-profile-") as out:
        from benchmarks.runner.processes import run_measured

        _, stderr, code, _ = run_measured([sys.executable, "-m", "cputrain", "train", f"output_dir={out}",
                                           *overrides, f"train.profile_step={step}"])
        if code:
            raise RuntimeError(f"profiled run failed:\n{stderr[-3000:]}")
        profile = json.loads((Path(out) / f"profile_step{step}.json").read_text())
    return {"step_s": profile["step_s"], **{f: profile["families"].get(f, {}).get("self_s", 0.0) for f in FAMILIES}}


@contextmanager
def preloaded(allocator: str, tcmalloc: str | None):
    """The case's allocator for the runs started inside: tcmalloc through LD_PRELOAD (found by the
    run as "in LD_PRELOAD", so no library need be installed where the script names one)."""
    before = os.environ.get("LD_PRELOAD")
    if allocator == "tcmalloc":
        os.environ["LD_PRELOAD"] = tcmalloc
    try:
        yield [f"hardware.allocator={allocator}"]
    finally:
        if before is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = before


def measure(sizes: list[str], precisions: list[str], rounds: int, steps: int, tmp: Path, tcmalloc: str | None,
            profile_sizes: list[str], allocators: list[str]) -> list[dict]:
    """`allocators`: tcmalloc and/or glibc, the cases run on each."""
    have_deepspeed = importlib.util.find_spec("deepspeed") is not None
    cases = [(label, o, alloc) for label, o, alloc in CASES
             if (have_deepspeed or o is not ZERO3) and (tcmalloc or alloc != "tcmalloc")
             and ("tcmalloc" if alloc == "tcmalloc" else "glibc") in allocators]
    results = []
    for size in sizes:
        for precision in precisions:
            base = [*SIZES[size], *common(steps, tmp / "cache"), f"hardware.precision={precision}"]
            times: dict[str, list[float]] = {label: [] for label, _, _ in cases}
            peaks: dict[str, float] = {}
            for _ in range(rounds):  # alternated: drift in the machine hits every case alike
                for label, overrides, alloc in cases:
                    with preloaded(alloc, tcmalloc) as allocator:
                        run = train_measured([*base, *overrides, *allocator], what=f"{size} {precision} {label}")
                    times[label].append(median_step_s(run.metrics_rows))
                    peaks[label] = run.step_peak["rss_gib"]
                    print(f"{size} {precision} {label}: {times[label][-1]:.3f} s", flush=True)
            for label, overrides, alloc in cases:
                step_s = statistics.median(times[label])
                families = None
                if size in profile_sizes:
                    with preloaded(alloc, tcmalloc) as allocator:
                        families = profiled([*base, *overrides, *allocator], max(3, steps - 1))
                results.append({"size": size, "precision": precision, "case": label, "step_s": step_s,
                                "vs_single": step_s / statistics.median(times[SINGLE_OF[alloc]]),
                                "step_peak_gib": peaks[label], "families": families})
    return results


def write(results: list[dict], rounds: int, steps: int, quick: bool, tcmalloc: str | None, block: str,
          command: str) -> None:
    lines = [machine_line(), "",
             f"`{command}`: one rank alone (2 threads, "
             f"nothing to communicate), seq 512, global batch 8 in micro-batches of 2, {steps} steps, median step of "
             f"the steps after the first two, median of {rounds} alternated round(s); attention sdpa, every other "
             "`auto` cputrain's. "
             + ("Each case on glibc (what `auto` gives it without tcmalloc: tuned, keeping what a step frees, for "
                "single; as is with its mmap threshold pinned for fsdp and zero3) and on tcmalloc "
                if any("glibc" in r["case"] for r in results) else "Each case on tcmalloc only ")
             + (f"(preloaded: {Path(tcmalloc).name}, as the training image has it)" if tcmalloc else
                "(not installed here: no tcmalloc rows)")
             + "; ÷ single is the single case on the same allocator.", "",
             "| size | precision | case | step s | ÷ single | step peak GiB |",
             "| --- | --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['size']} | {r['precision']} | {r['case']} | {r['step_s']:.3f} | {r['vs_single']:.2f}× | "
              f"{r['step_peak_gib']:.2f} |" for r in results]
    profiled_rows = [r for r in results if r["families"]]
    if profiled_rows:
        lines += ["", "The profiled step (one more run of each case), seconds by operator family "
                      "(cputrain.metrics.step_profile):", "",
                  "| size | precision | case | step | " + " | ".join(FAMILIES) + " |",
                  "| --- | --- | --- | ---: | " + " | ".join("---:" for _ in FAMILIES) + " |"]
        lines += [f"| {r['size']} | {r['precision']} | {r['case']} | {r['families']['step_s']:.2f} | "
                  + " | ".join(f"{r['families'][f]:.2f}" for f in FAMILIES) + " |" for r in profiled_rows]
    print_and_write_block(block, "\n".join(lines), None, quick)


def size_args(description: str, sizes: str) -> argparse.ArgumentParser:
    """The options this script and two_ranks.py share: sizes, precisions, rounds, steps, tcmalloc."""
    from cputrain.native.allocator import find_allocator

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps, one round: checks the script only")
    parser.add_argument("--sizes", default=sizes)
    parser.add_argument("--precisions", default="bf16,fp32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tcmalloc", default=find_allocator("tcmalloc"),
                        help="tcmalloc's library for the tcmalloc cases (default: the installed one; none: no such cases)")
    return parser


def sizes_of(args: argparse.Namespace) -> tuple[list[str], list[str], int, int]:
    """(sizes, precisions, rounds, steps); --quick: the tiny model in fp32, one round of 4 steps."""
    if args.quick:
        SIZES["tiny"] = MODEL_TINY
        return ["tiny"], ["fp32"], 1, 4
    return args.sizes.split(","), args.precisions.split(","), args.rounds, args.steps


def main() -> None:
    parser = size_args(__doc__, "demo,34m,100m")
    parser.add_argument("--profile-sizes", default="demo,34m,100m", help="the sizes whose cases are profiled once more")
    parser.add_argument("--allocators", default="glibc,tcmalloc", help="the allocators the cases run on")
    parser.add_argument("--block", default="sharded_rank",
                        choices=("sharded_rank", "sharded_rank_fp32", "sharded_rank_bf16"),
                        help="the block written (sharded_rank_fp32: the fp32 rows, kept beside bf16's; "
                             "sharded_rank_bf16: bf16 on tcmalloc, kept beside the block with glibc's rows)")
    args = parser.parse_args()
    sizes, precisions, rounds, steps = sizes_of(args)
    profile_sizes = ["tiny"] if args.quick else args.profile_sizes.split(",")
    allocators = args.allocators.split(",")
    with tempfile.TemporaryDirectory(prefix="sharded-rank-") as tmp:
        results = measure(sizes, precisions, rounds, steps, Path(tmp), args.tcmalloc, profile_sizes, allocators)
    write(results, rounds, steps, args.quick, args.tcmalloc, args.block, command_as_run())


if __name__ == "__main__":
    main()
