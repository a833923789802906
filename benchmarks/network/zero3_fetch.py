"""ZeRO-3 fetching each decoder block whole against DeepSpeed's per-module fetch.

DeepSpeed puts its fetch and release hooks on every module that holds parameters (each linear, each
norm) and runs them in Python on every micro-batch. The zero3 strategy makes each decoder block a
DeepSpeed leaf module, so a block's parameters are fetched and released together, one hook pair per
block. Measured here side by side: one rank alone against the single strategy, and two ranks on
one node against DDP, each case alternated round by round, median step of the steps after the
first two, median over rounds; "modules" is the zero3 strategy given a DeepSpeed file whose
`zero_optimization.leaf_module` is empty (DeepSpeed's own default), "blocks" the strategy as it
runs. Every case on tcmalloc where given (preloaded, as the training image has it), else glibc as
`auto` gives it. The largest loss difference between modules and blocks over the run's steps is
shown: the same computation, fetched in other groups. Writes block `zero3_fetch` of
docs/benchmarks/network.md.

    python benchmarks/network/zero3_fetch.py                   # the figures (a quiet machine)
    python benchmarks/network/zero3_fetch.py --sizes 34m --ranks 1 --rounds 3
    python benchmarks/network/zero3_fetch.py --tcmalloc /path/to/libtcmalloc_minimal.so.4
    python benchmarks/network/zero3_fetch.py --quick           # tiny model, 4 steps: checks the script only

`--persistence 100000,1000000000` adds a case per threshold: the blocks fetched whole, and every
parameter of at most that many elements kept whole on every rank (DeepSpeed's
`stage3_param_persistence_threshold`; cputrain's generated file sets 10 × hidden, the Hugging Face
Trainer's value). Those rounds write block `zero3_persistence`.

`--reduce-bucket` adds a case of the blocks fetched whole with DeepSpeed's reduce bucket at one
decoder block's parameters (so a block's gradients are reduced in one collective), against the
bucket as generated: h² elements, the Hugging Face Trainer's value (~1/12 of a Llama block). Those
rounds write block `zero3_reduce_bucket`.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.network.sharded_rank import (SIZES, TOKENS_PER_STEP, ZERO3, common, median_step_s, preloaded,  # noqa: E402
                                             size_args, sizes_of)
from benchmarks.runner.blocks import command_as_run, print_and_write_block  # noqa: E402
from benchmarks.runner.cputrain_run import train_measured  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402

def cases(ranks: int, per_module_file: Path, variants: dict[str, Path]) -> list[tuple[str, list[str]]]:
    peer = ("single", ["parallel.strategy=single"]) if ranks == 1 else ("ddp", ["parallel.strategy=ddp"])
    if variants:  # the blocks as the strategy runs them, against each DeepSpeed file
        return [peer, ("zero3 blocks", ZERO3), *((label, [*ZERO3, f"parallel.deepspeed_config={f}"])
                                                 for label, f in variants.items())]
    return [peer, ("zero3 modules", [*ZERO3, f"parallel.deepspeed_config={per_module_file}"]), ("zero3 blocks", ZERO3)]


def deepspeed_file(tmp: Path, name: str, zero: dict) -> Path:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, **zero}}))
    return path


def variant_files(thresholds: list[int], reduce_bucket: bool, size: str, tmp: Path) -> dict[str, Path]:
    """The DeepSpeed files the blocks as run are weighed against: one per persistence threshold, or
    the reduce bucket at one decoder block of this size (its parameters as the memory plan counts them)."""
    files = {f"zero3 blocks, persist ≤ {n:,}": deepspeed_file(tmp, f"persist-{n}", {"stage3_param_persistence_threshold": n})
             for n in thresholds}
    if reduce_bucket:
        from cputrain.config.file import load_config
        from cputrain.plan.model_shape import model_shape

        units = model_shape(load_config(None, SIZES[size]).model).unit_params()
        block = max(n for unit, n in units.items() if unit != "root")
        files[f"zero3 blocks, reduce bucket a block ({block:,})"] = deepspeed_file(
            tmp, f"bucket-{size}", {"reduce_bucket_size": block})
    return files


def losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def measure(sizes: list[str], two_rank_sizes: list[str], precisions: list[str], ranks_list: list[int], rounds: int,
            steps: int, tmp: Path, tcmalloc: str | None, thresholds: list[int], reduce_bucket: bool) -> list[dict]:
    per_module = tmp / "per-module.json"
    per_module.write_text(json.dumps({"zero_optimization": {"stage": 3, "leaf_module": {}}}))
    allocator = "tcmalloc" if tcmalloc else "system"
    results = []
    for ranks in ranks_list:
        for size in (sizes if ranks == 1 else two_rank_sizes):
            variants = variant_files(thresholds, reduce_bucket, size, tmp)
            for precision in precisions:
                base = [*SIZES[size], *common(steps, tmp / "cache"), f"hardware.precision={precision}",
                        *(["--nproc-per-node", str(ranks)] if ranks > 1 else [])]
                times: dict[str, list[float]] = {}
                peaks, first_losses = {}, {}
                for _ in range(rounds):  # alternated: drift in the machine hits every case alike
                    for label, overrides in cases(ranks, per_module, variants):
                        alloc = "glibc-tuned" if label in ("single", "ddp") and not tcmalloc else allocator
                        with preloaded(alloc, tcmalloc) as chosen:
                            run = train_measured([*base, *overrides, *chosen], what=f"{size} {precision} {label}")
                        times.setdefault(label, []).append(median_step_s(run.metrics_rows))
                        peaks[label] = run.step_peak["rss_gib"]
                        first_losses.setdefault(label, losses(run.metrics_rows))
                        print(f"{ranks} rank(s) {size} {precision} {label}: {times[label][-1]:.3f} s", flush=True)
                labels = [label for label, _ in cases(ranks, per_module, variants)]
                peer_s = statistics.median(times[labels[0]])
                # modules, or the first variant: against the blocks as run
                other = next(label for label in labels[1:] if label != "zero3 blocks")
                drift = max(abs(first_losses["zero3 blocks"][s] - first_losses[other][s]) for s in first_losses[other])
                for label in labels:
                    step_s = statistics.median(times[label])
                    results.append({"ranks": ranks, "size": size, "precision": precision, "case": label,
                                    "step_s": step_s, "vs_peer": peer_s / step_s if ranks > 1 else step_s / peer_s,
                                    "tokens_s": TOKENS_PER_STEP / step_s, "step_peak_gib": peaks[label],
                                    "loss_drift": drift if label.startswith("zero3") else None})
    return results


def write(results: list[dict], rounds: int, steps: int, quick: bool, tcmalloc: str | None, command: str,
          block: str) -> None:
    lines = [machine_line(), "",
             f"`{command}`: seq 512, global batch 8 in "
             f"micro-batches of 2, {steps} steps, median step of the steps after the first two, median of {rounds} "
             "alternated round(s); attention sdpa, every other `auto` cputrain's; "
             + (f"tcmalloc preloaded ({Path(tcmalloc).name})" if tcmalloc else "glibc as `auto` gives each case")
             + ". One rank: ÷ single is the step over the single strategy's (lower is better); two ranks (1 thread "
               "each, one node): × ddp is tokens/s over DDP's (higher is better). |Δ loss| is the largest "
               "difference between the blocks run's losses and the other zero3 case's over the steps (modules, or "
               "the first DeepSpeed file weighed against them).", "",
             "| ranks | size | precision | case | step s | tokens/s | vs peer | step peak GiB | \\|Δ loss\\| |",
             "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        vs = f"{r['vs_peer']:.2f}× " + ("÷ single" if r["ranks"] == 1 else "ddp")
        drift = "" if r["loss_drift"] is None else f"{r['loss_drift']:.1e}"
        lines.append(f"| {r['ranks']} | {r['size']} | {r['precision']} | {r['case']} | {r['step_s']:.3f} | "
                     f"{r['tokens_s']:.0f} | {vs} | {r['step_peak_gib']:.2f} | {drift} |")
    print_and_write_block(block, "\n".join(lines), None, quick)


def main() -> None:
    parser = size_args(__doc__, "demo,34m,100m")
    parser.set_defaults(precisions="bf16")
    parser.add_argument("--ranks", default="1,2", help="1: one rank against single; 2: two ranks against ddp")
    parser.add_argument("--two-rank-sizes", default="100m", help="the sizes two ranks run at")
    parser.add_argument("--persistence", default="", help="thresholds (elements) to run against the blocks as run")
    parser.add_argument("--reduce-bucket", action="store_true",
                        help="the reduce bucket at one block against h² (as generated, the Trainer's)")
    parser.add_argument("--block", default="", help="the block written (default: by the cases run)")
    args = parser.parse_args()
    thresholds = [int(n) for n in args.persistence.split(",") if n]
    sizes, precisions, rounds, steps = sizes_of(args)
    two_rank_sizes = sizes if args.quick else args.two_rank_sizes.split(",")
    with tempfile.TemporaryDirectory(prefix="zero3-fetch-") as tmp:
        results = measure(sizes, two_rank_sizes, precisions, [int(n) for n in args.ranks.split(",")], rounds, steps,
                          Path(tmp), args.tcmalloc, thresholds, args.reduce_bucket)
    block = args.block or ("zero3_persistence" if thresholds else "zero3_reduce_bucket" if args.reduce_bucket
                           else "zero3_fetch")
    write(results, rounds, steps, args.quick, args.tcmalloc, command_as_run(), block)


if __name__ == "__main__":
    main()
