"""OpenMP workers that sleep: a rank's operators after its first gloo collective, with libgomp's
default waits and with the waits `cputrain train` sets (cputrain/native/openmp_waits.py).

Two parts, each side by side in one run:
- the mechanism: in a fresh process on 2 threads (or --threads), the median time of one
  elementwise product of 512K floats after a pause of 0, 30 and 100 µs of Python, before the
  process forms a gloo group, and after one all-gather on a group of one rank: gloo's worker
  threads run the collective's copies as torch operators, each gets an OpenMP thread pool, and
  libgomp counts more threads than CPUs from then on;
- the step: one rank alone, the single strategy (no process group) and zero3 (DeepSpeed's
  collectives on gloo), each with libgomp's defaults (GOMP_SPINCOUNT=300000 set alone, which is
  those defaults and which cputrain keeps) and with cputrain's waits, alternated round by round,
  median step of the steps after the first two, median over rounds; ÷ single is over the single
  strategy's step with cputrain's waits.
Every case on tcmalloc where installed (preloaded, as the training image has it). Writes block
`openmp_waits` of docs/benchmarks/network.md.

    python benchmarks/network/openmp_waits.py                   # the figures (a quiet machine)
    python benchmarks/network/openmp_waits.py --sizes demo --rounds 5
    python benchmarks/network/openmp_waits.py --quick           # tiny model, 4 steps: checks the script only
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.network.sharded_rank import (SINGLE, SIZES, ZERO3, common, median_step_s, preloaded,  # noqa: E402
                                             size_args, sizes_of)
from benchmarks.runner.blocks import command_as_run, print_and_write_block  # noqa: E402
from benchmarks.runner.cputrain_run import train_measured  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402
from cputrain.native.openmp_waits import WAITS, WAITS_TEXT  # noqa: E402

# libgomp's own defaults, written out: a variable set by the user keeps cputrain's waits out.
LIBGOMP_DEFAULTS = {"GOMP_SPINCOUNT": "300000"}
SIDES = {"libgomp defaults": LIBGOMP_DEFAULTS, "cputrain's waits": {}}
GAPS_US = (0, 30, 100)

# One fresh process per side: libgomp reads its variables once, as torch loads it.
PROBE = r"""
import json, os, statistics, sys, time
import torch
import torch.distributed as dist

torch.set_num_threads(int(sys.argv[1]))
x = torch.randn(512 * 1024)

def pause(us):
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass

def product_us(gap_us):
    times = []
    for _ in range(400):
        pause(gap_us)
        t = time.perf_counter()
        x.mul_(1.0000001)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6

gaps = json.loads(sys.argv[2])
before = {g: product_us(g) for g in gaps}
threads_before = len(os.listdir("/proc/self/task"))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
big = torch.randn(4 * 1024 * 1024)
out = torch.empty_like(big)
for _ in range(3):
    dist.all_gather_into_tensor(out, big)
after = {g: product_us(g) for g in gaps}
print(json.dumps({"before": before, "after": after, "threads_before": threads_before,
                  "threads_after": len(os.listdir("/proc/self/task"))}))
dist.destroy_process_group()
"""


@contextmanager
def waits(extra: dict[str, str]):
    """The environment of the runs started inside: none of the wait variables but `extra`."""
    saved = {name: os.environ.get(name) for name in (*WAITS, *LIBGOMP_DEFAULTS)}
    for name in saved:
        os.environ.pop(name, None)
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def probe(threads: int, rounds: int) -> list[dict]:
    """The mechanism, per side: medians over alternated rounds of fresh processes."""
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for _ in range(rounds):
        for side, extra in SIDES.items():
            # the probe is a plain python process: cputrain's waits are given to it as `cputrain train` sets them
            env = {name: value for name, value in os.environ.items() if name not in (*WAITS, *LIBGOMP_DEFAULTS)}
            env.update(extra or WAITS)
            out = subprocess.run([sys.executable, "-c", PROBE, str(threads), json.dumps(GAPS_US)], env=env,
                                 capture_output=True, text=True, check=True)
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for side, got in runs.items():
        for when in ("before", "after"):
            rows.append({"side": side, "when": when,
                         "threads": got[0][f"threads_{when}"],
                         "us": {g: statistics.median(r[when][str(g)] for r in got) for g in GAPS_US}})
    return rows


def measure(sizes: list[str], precisions: list[str], rounds: int, steps: int, tmp: Path,
            tcmalloc: str | None) -> list[dict]:
    cases = [(f"{strategy}, {side}", overrides, extra) for strategy, overrides in (("single", SINGLE), ("zero3", ZERO3))
             for side, extra in SIDES.items()]
    other_side = dict(zip(SIDES, reversed(list(SIDES))))
    alloc = "tcmalloc" if tcmalloc else "system"
    results = []
    for size in sizes:
        for precision in precisions:
            base = [*SIZES[size], *common(steps, tmp / "cache"), f"hardware.precision={precision}"]
            times: dict[str, list[float]] = {label: [] for label, _, _ in cases}
            losses: dict[str, list[float]] = {}
            for _ in range(rounds):  # alternated: drift in the machine hits every case alike
                for label, overrides, extra in cases:
                    with waits(extra), preloaded(alloc, tcmalloc) as allocator:
                        run = train_measured([*base, *overrides, *allocator], what=f"{size} {precision} {label}")
                    times[label].append(median_step_s(run.metrics_rows))
                    losses.setdefault(label, [r["loss"] for r in run.metrics_rows if "loss" in r])
                    print(f"{size} {precision} {label}: {times[label][-1]:.3f} s", flush=True)
            single_s = statistics.median(times["single, cputrain's waits"])
            for label, _, _ in cases:
                step_s = statistics.median(times[label])
                strategy, side = label.split(", ", 1)
                drift = max(abs(a - b) for a, b in zip(losses[label], losses[f"{strategy}, {other_side[side]}"]))
                results.append({"size": size, "precision": precision, "case": label, "step_s": step_s,
                                "rounds_s": times[label], "vs_single": step_s / single_s, "loss_drift": drift})
    return results


def write(mechanism: list[dict], results: list[dict], threads: int, rounds: int, steps: int, quick: bool,
          tcmalloc: str | None, command: str) -> None:
    lines = [machine_line(), "",
             f"`{command}`. The mechanism: one elementwise product of 512K floats on {threads} threads, median of "
             f"400 after a pause of Python, in a fresh process per side and round ({rounds} alternated rounds, "
             "median), before the process forms a gloo group and after one all-gather on a group of one rank. "
             "Side \"libgomp defaults\" is GOMP_SPINCOUNT=300000 set alone (libgomp's own default, which "
             f"cputrain then keeps); \"cputrain's waits\" is {WAITS_TEXT}.", "",
             "| side | when | process threads | " + " | ".join(f"after {g} µs, µs" for g in GAPS_US) + " |",
             "| --- | --- | ---: | " + " | ".join("---:" for _ in GAPS_US) + " |"]
    for r in mechanism:
        lines.append(f"| {r['side']} | {r['when']} the collective | {r['threads']} | "
                     + " | ".join(f"{r['us'][g]:.0f}" for g in GAPS_US) + " |")
    lines += ["", f"The step: one rank alone (2 threads), seq 512, global batch 8 in micro-batches of 2, {steps} steps, "
                  f"median step of the steps after the first two, median of {rounds} alternated round(s); attention "
                  "sdpa, every other `auto` cputrain's; "
                  + (f"tcmalloc preloaded ({Path(tcmalloc).name})" if tcmalloc else "glibc as is")
                  + ". ÷ single is over the single strategy's step with cputrain's waits. |Δ loss| is the largest "
                    "difference between a case's losses and the same strategy's on the other side.", "",
              "| size | precision | case | step s | rounds, s | ÷ single | \\|Δ loss\\| |",
              "| --- | --- | --- | ---: | --- | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['size']} | {r['precision']} | {r['case']} | {r['step_s']:.3f} | "
                     f"{', '.join(f'{t:.2f}' for t in r['rounds_s'])} | {r['vs_single']:.2f}× | {r['loss_drift']:.1e} |")
    print_and_write_block("openmp_waits", "\n".join(lines), None, quick)


def main() -> None:
    parser = size_args(__doc__, "demo,34m")
    parser.set_defaults(precisions="fp32", rounds=3, steps=8)
    parser.add_argument("--threads", type=int, default=2, help="the probe's threads")
    args = parser.parse_args()
    sizes, precisions, rounds, steps = sizes_of(args)
    mechanism = probe(args.threads, 1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="openmp-waits-") as tmp:
        results = measure(sizes, precisions, rounds, steps, Path(tmp), args.tcmalloc)
    write(mechanism, results, args.threads, rounds, steps, args.quick, args.tcmalloc, command_as_run())


if __name__ == "__main__":
    main()
