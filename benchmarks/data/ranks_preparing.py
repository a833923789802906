"""N ranks of one node arriving at a missing cache: how many builder processes start, the node's
memory and the time to a trained step, against another checkout of cputrain (`--before`).

Every rank of `cputrain train --nproc-per-node N` prepares its data at the same moment, on an empty
data.cache_dir. One process builds each cache entry (cputrain.data.cache_lock); the question is
what the others do meanwhile. This script counts the builders: spawned processes
(`--multiprocessing-fork`) whose parent is a rank, not a builder (a builder's own tokenizing
workers are not counted). It samples the process tree every 0.2 s for its summed PSS (pages
shared between processes counted once), and times the whole command: N ranks, the embedded
demo corpus, a tokenizer trained on it and its token cache built, then 2 training steps.

    python benchmarks/data/ranks_preparing.py --before /path/to/an/older/checkout   # 2, 4, 8 ranks, 3 runs each
    python benchmarks/data/ranks_preparing.py --quick                               # 2 ranks, one run, this tree only
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.blocks import block_parser, command_as_run, print_and_write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402
from benchmarks.runner.timing import median  # noqa: E402
from cputrain.data.tree_memory import GIB, TreeMemory  # noqa: E402

SPAWNED = "--multiprocessing-fork"


class TreeSampler(TreeMemory):
    """TreeMemory's peak of the tree's summed PSS, with the builders seen in it and the peak while
    one was alive."""

    def __init__(self, pid: int):
        self.preparing_peak_bytes, self.builders = 0, set()
        super().__init__(pid)

    def _sample(self) -> int:
        total, preparing = 0, False
        for proc in [self.root, *self.root.children(recursive=True)]:
            try:
                total += proc.memory_full_info().pss
                if SPAWNED in proc.cmdline() and SPAWNED not in proc.parent().cmdline():
                    self.builders.add(proc.pid)
                    preparing = True
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, AttributeError):
                pass  # ended between the listing and the read
        if preparing:
            self.preparing_peak_bytes = max(self.preparing_peak_bytes, total)
        return total

    def figures(self) -> dict:
        return {"peak_gib": self.stop(), "preparing_peak_gib": self.preparing_peak_bytes / GIB,
                "builders": len(self.builders)}


def run(tree: Path, ranks: int, work: Path) -> dict:
    """One run of `cputrain train` with `ranks` ranks from the package in `tree`, on an empty cache."""
    cache, out = tempfile.mkdtemp(dir=work), tempfile.mkdtemp(dir=work)
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    # 4 rows a rank a step whatever the ranks (the demo's micro-batch), so every count divides the batch
    cmd = [sys.executable, "-m", "cputrain", "train", "--nproc-per-node", str(ranks), "train.max_steps=2",
           f"train.global_batch_size={4 * ranks}", f"data.cache_dir={cache}", f"output_dir={out}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=work)
    sampler = TreeSampler(proc.pid)
    _, err = proc.communicate()
    wall_s = time.perf_counter() - t0
    memory = sampler.figures()
    subprocess.run(["rm", "-rf", cache, out])
    if proc.returncode:
        raise SystemExit(f"{ranks} ranks from {tree} failed:\n{err[-3000:]}")
    return {"wall_s": wall_s, **memory}


def _commit(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main() -> None:
    parser = block_parser("data.md", runs=3, quick="2 ranks, one run, this tree only: checks the script")
    parser.add_argument("--before", type=Path, help="a checkout whose cputrain runs beside this one's")
    parser.add_argument("--ranks", default="2,4,8")
    args = parser.parse_args()
    rank_counts = [2] if args.quick else [int(n) for n in args.ranks.split(",")]
    runs = 1 if args.quick else args.runs
    sides = {"this tree": REPO}
    if args.before and not args.quick:
        sides = {"before": args.before.resolve(), **sides}
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for ranks in rank_counts:
            results: dict[str, list[dict]] = {side: [] for side in sides}
            for _ in range(runs):  # the sides alternated, so a slow minute of the machine hits both
                for side, tree in sides.items():
                    results[side].append(run(tree, ranks, Path(work)))
                    print(side, ranks, results[side][-1], file=sys.stderr)
            for side, runs_of_side in results.items():
                rows.append((ranks, side, max(r["builders"] for r in runs_of_side),
                             median([r["preparing_peak_gib"] for r in runs_of_side]),
                             median([r["peak_gib"] for r in runs_of_side]), median([r["wall_s"] for r in runs_of_side])))
    names = ", ".join(f"{side}: commit {_commit(tree)}" for side, tree in sides.items())
    lines = [machine_line(), "",
             f"`{command_as_run()}` ({names}): `cputrain train --nproc-per-node N train.max_steps=2` on the embedded "
             f"demo, an empty data.cache_dir each run (a tokenizer trained, then the token cache built); builders: "
             f"the most spawned processes whose parent is a rank seen in a run; peaks: the process tree's summed PSS, "
             f"sampled every 0.2 s, while a builder was alive and over the whole run; global batch 4 rows a rank; "
             f"medians of {runs} alternated run(s).", "",
             "| ranks | cputrain | builders started | peak GiB while preparing | peak GiB, whole run | wall s, to 2 steps |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {n} | {side} | {b} | {prep:.2f} | {peak:.2f} | {wall:.1f} |" for n, side, b, prep, peak, wall in rows]
    print_and_write_block("ranks_preparing", "\n".join(lines), args.doc, args.quick)


if __name__ == "__main__":
    main()
