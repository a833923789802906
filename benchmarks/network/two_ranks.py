"""Two ranks on one node: fsdp and zero3 against ddp, on each allocator `auto` can give them.

The sharded strategies exist for memory; on CPUs a rank's own work decides whether they also keep
DDP's speed. Here two ranks share one node (one core each, gloo on loopback, nothing crossing a
real network), ~34M and ~100M Llamas, seq 512, global batch 8 in micro-batches of 2, each case on
glibc (what `auto` gives it without tcmalloc: tuned for ddp, as is with its mmap threshold pinned
for fsdp and zero3) and on tcmalloc (preloaded, as the training image has it), alternated round by
round; the median step of the steps after the first two, median over rounds, tokens/s ÷ ddp's on
the same allocator, and rank 0's step peak. Writes block `two_ranks` of docs/benchmarks/network.md.

    python benchmarks/network/two_ranks.py                 # the figures (a quiet machine)
    python benchmarks/network/two_ranks.py --sizes 100m --precisions bf16 --rounds 2
    python benchmarks/network/two_ranks.py --sizes 100m --no-glibc   # tcmalloc's rows alone (the image's allocator)
    python benchmarks/network/two_ranks.py --sizes 34m --no-glibc --block two_ranks_34m
    python benchmarks/network/two_ranks.py --sizes 100m --no-glibc --block two_ranks_overlap \
        --cases "ddp,fsdp gather_once (waited),fsdp gather_once"
    python benchmarks/network/two_ranks.py --quick         # tiny model, 3 steps: checks the script only
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.network.sharded_rank import (FULL_SHARD, GATHER_ONCE, SIZES, TOKENS_PER_STEP, ZERO3, common,  # noqa: E402
                                             median_step_s, preloaded, size_args, sizes_of)
from benchmarks.runner.blocks import command_as_run, print_and_write_block  # noqa: E402
from benchmarks.runner.cputrain_run import train_measured  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402

# gather_once: each block gathered once a step and its gradients kept unsharded through the step's
# micro-batches (DDP's traffic and memory for parameters and gradients; the optimizer state sharded)
# (gather_once leaves its reduce-scatter running behind the backward, parallel.overlap_reduction;
# "waited" is each block's reduce-scatter waited for, as FSDP2 runs it: --cases picks it)
CASES = [("ddp", ["parallel.strategy=ddp"]), ("fsdp full_shard", FULL_SHARD), ("fsdp gather_once", GATHER_ONCE),
         ("zero3", ZERO3), ("fsdp gather_once (waited)", [*GATHER_ONCE, "parallel.overlap_reduction=false"])]
DEFAULT_CASES = "ddp,fsdp full_shard,fsdp gather_once,zero3"
# what auto gives each strategy without tcmalloc, then tcmalloc
GLIBC = {"ddp": "glibc-tuned", "fsdp full_shard": "system", "fsdp gather_once": "system", "zero3": "system",
         "fsdp gather_once (waited)": "system"}


def measure(sizes: list[str], precisions: list[str], rounds: int, steps: int, tmp: Path, tcmalloc: str | None,
            glibc: bool = True, labels: str = DEFAULT_CASES) -> list[dict]:
    have_deepspeed = importlib.util.find_spec("deepspeed") is not None
    cases = [(label, o) for label, o in CASES if (have_deepspeed or o is not ZERO3) and label in labels.split(",")]
    allocators = (["glibc"] if glibc or not tcmalloc else []) + (["tcmalloc"] if tcmalloc else [])
    results = []
    for size in sizes:
        for precision in precisions:
            base = [*SIZES[size], *common(steps, tmp / "cache"), f"hardware.precision={precision}", "--nproc-per-node", "2"]
            times: dict[tuple[str, str], list[float]] = {}
            peaks: dict[tuple[str, str], float] = {}
            for _ in range(rounds):  # alternated: drift in the machine hits every case alike
                for label, overrides in cases:
                    for family in allocators:
                        alloc = GLIBC[label] if family == "glibc" else "tcmalloc"
                        with preloaded(alloc, tcmalloc) as allocator:
                            run = train_measured([*base, *overrides, *allocator], what=f"{size} {precision} {label}")
                        times.setdefault((label, family), []).append(median_step_s(run.metrics_rows))
                        peaks[(label, family)] = run.step_peak["rss_gib"]
                        print(f"{size} {precision} {label} {family}: {times[(label, family)][-1]:.3f} s", flush=True)
            for family in allocators:
                ddp_s = statistics.median(times[("ddp", family)])
                for label, _ in cases:
                    step_s = statistics.median(times[(label, family)])
                    results.append({"size": size, "precision": precision, "case": label, "allocator": family,
                                    "step_s": step_s, "tokens_per_s": TOKENS_PER_STEP / step_s,
                                    "vs_ddp": ddp_s / step_s, "step_peak_gib": peaks[(label, family)]})
    return results


def write(results: list[dict], rounds: int, steps: int, quick: bool, tcmalloc: str | None, command: str,
          block: str) -> None:
    lines = [machine_line(), "",
             f"`{command}`: 2 ranks on one node (1 thread "
             f"each), seq 512, global batch 8 in micro-batches of 2, {steps} steps, median step of the steps after "
             f"the first two, median of {rounds} alternated round(s); "
             + ("glibc as `auto` gives each strategy without tcmalloc (tuned for ddp, as is for fsdp and zero3), "
                if any(r["allocator"] == "glibc" for r in results) else "no glibc rows (--no-glibc), ")
             + "tcmalloc " + (f"preloaded ({Path(tcmalloc).name})" if tcmalloc else "not installed here (no rows)")
             + "; ÷ ddp is ddp's step on the same allocator over this one's.", "",
             "| size | precision | allocator | case | step s | tokens/s | × ddp's tokens/s | rank 0 step peak GiB |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['size']} | {r['precision']} | {r['allocator']} | {r['case']} | {r['step_s']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {r['vs_ddp']:.2f}× | {r['step_peak_gib']:.2f} |" for r in results]
    print_and_write_block(block, "\n".join(lines), None, quick)


def main() -> None:
    parser = size_args(__doc__, "34m,100m")
    parser.add_argument("--no-glibc", action="store_true", help="tcmalloc's rows alone (what the training image runs)")
    parser.add_argument("--block", default="two_ranks", choices=("two_ranks", "two_ranks_34m", "two_ranks_overlap"),
                        help="the block written (two_ranks_34m: ~34M's rows, kept beside ~100M's; two_ranks_overlap: "
                             "gather_once's reduce-scatter left running against waited for)")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="the cases run, by label, comma-separated (ddp first)")
    args = parser.parse_args()
    sizes, precisions, rounds, steps = sizes_of(args)
    with tempfile.TemporaryDirectory(prefix="two-ranks-") as tmp:
        results = measure(sizes, precisions, rounds, steps, Path(tmp), args.tcmalloc, glibc=not args.no_glibc,
                          labels=args.cases)
    write(results, rounds, steps, args.quick, args.tcmalloc, command_as_run(), args.block)


if __name__ == "__main__":
    main()
