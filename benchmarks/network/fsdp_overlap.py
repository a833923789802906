"""Does gather_once's reduce-scatter hide behind the last backward when it is left running?

    python benchmarks/network/fsdp_overlap.py [--quick]

Two network namespaces joined by a veth pair shaped by `tc` (benchmarks/network/gloo_link.py's), one
rank in each on its own core, one thread (gloo's thread shares the core with the compute). A ~34M
Llama, FSDP gather_once, gradients reduced in fp32, bf16 compute where the CPU has it, at link rates
where the step's reduce-scatter is about one and two last backwards long; each rate with
parallel.overlap_reduction=false (each block's all-to-all waited for as FSDP2 issues it) and =true
(left running while the next blocks' backward computes, summed when the backward ends), alternated,
median step of the steps after the first two, medians of the repetitions.

The share hidden is what overlapping saved over the shorter of the two things that could overlap:
the blocks' reduce-scatters (the plan's share of the measured network time: the step without
overlap less one gather_once rank alone, nothing to communicate) and the backward they can run
behind (the last micro-batch's: two thirds of one micro-batch of that rank alone, less one block's).
The time plan hides that share of the shorter, at most all of it (cputrain.plan.time.overlap.REDUCE_HIDDEN_SHARE:
never more than the window or the transfer). Writes block
`fsdp_overlap` of docs/benchmarks/network.md.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.network.gloo_link import (WARMUP_STEPS, off_and_on_args, off_and_on_steps, _clean_env, median_step_s,  # noqa: E402
                                          plan_at_half_peak, run_settings, shape_link, train_one_rank_per_node,
                                          two_nodes)

WORLD = 2
MICRO_BATCHES = 4
GATHER_ONCE = ["parallel.strategy=fsdp", "parallel.layout=gather_once", "parallel.reduce_dtype=fp32"]


def _flag(overlap: bool) -> str:
    return f"parallel.overlap_reduction={'true' if overlap else 'false'}"


def train_two_nodes(names, settings, micro, overlap: bool, run_dir: Path) -> None:
    train_one_rank_per_node(names, [*settings, *GATHER_ONCE, _flag(overlap),
                                    f"train.global_batch_size={micro * MICRO_BATCHES * WORLD}"],
                            run_dir, "2-node gather_once run")


def alone_s(settings, micro, run_dir: Path) -> float:
    """One gather_once rank on core 0, nothing to communicate: its compute and FSDP2's own work."""
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "cputrain", "train", *settings, *GATHER_ONCE,
           f"train.global_batch_size={micro * MICRO_BATCHES}", "--nproc-per-node", "1", f"output_dir={run_dir}"]
    proc = subprocess.run(cmd, env=_clean_env(in_namespace=False), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return median_step_s(run_dir)


def reduce_share(settings, micro, link: float) -> tuple[float, int]:
    """The planned share of the network time that is the blocks' reduce-scatter, and the blocks."""
    plan, shape = plan_at_half_peak([*settings, *GATHER_ONCE, _flag(False),
                                     f"train.global_batch_size={micro * MICRO_BATCHES * WORLD}"], WORLD, link)
    reduces = sum(c.seconds for c in plan.collectives if c.kind == "reduce_scatter")
    return (reduces / plan.network_s if plan.network_s else 0.0), shape.layers


def main() -> None:
    args = off_and_on_args(__doc__, "0.25,0.5")
    seq_len, micro, reps = args.seq_len, args.micro, args.reps
    rows = []
    with tempfile.TemporaryDirectory(prefix="cputrain-overlap-") as tmp, two_nodes() as names:
        tmp = Path(tmp)
        settings = run_settings(args.model, seq_len, micro, args.steps, tmp / "cache")
        compute_s = alone_s(settings, micro, tmp / "alone")
        for rate in args.rate_list:
            off, on = off_and_on_steps(names, rate, reps, tmp, lambda overlap, run_dir: train_two_nodes(
                names, settings, micro, overlap, run_dir))
            share, layers = reduce_share(settings, micro, rate)
            reduces_s = max(0.0, off - compute_s) * share
            # the last micro-batch's backward (2/3 of a micro-batch), less its last block's: nothing
            # is left to run behind the first block's and the root's reductions
            window_s = compute_s / MICRO_BATCHES * 2 / 3 * (layers - 1) / layers
            shorter = min(reduces_s, window_s)
            rows.append({"rate": rate, "off": off, "on": on, "compute": compute_s, "reduces": reduces_s,
                         "window": window_s, "hidden_share": (off - on) / shorter if shorter > 0 else 0.0})
            print(rows[-1], flush=True)
        shape_link(names, None)
    markdown = block_markdown(rows, compute_s, reps, args.quick, micro, seq_len)
    print(markdown)
    if not args.no_write:
        from benchmarks.runner.blocks import write_block

        write_block("fsdp_overlap", markdown)


def block_markdown(rows: list[dict], compute_s: float, reps: int, quick: bool, micro: int, seq_len: int) -> str:
    from benchmarks.runner.machine import machine_line

    median_share = statistics.median(r["hidden_share"] for r in rows)
    lines = [machine_line(), "",
             f"`python benchmarks/network/fsdp_overlap.py`: 2 network namespaces, one rank each on its own core, one "
             f"thread, {'a tiny smoke model' if quick else 'a ~34M Llama'}, FSDP gather_once, gradients reduced "
             f"in fp32, precision auto, {MICRO_BATCHES} micro-batches of {micro} × {seq_len} per rank per step, over a "
             f"veth link shaped by `tc`; median step of the steps after the {WARMUP_STEPS} first, median of {reps} "
             f"alternated runs. Alone: one gather_once rank on one core, nothing to communicate, {compute_s:.2f} s a "
             "step. The blocks' reduce-scatters: the measured network time (the step without overlap less the rank "
             "alone) times the plan's share of it that is the reduce-scatter. The window: the last micro-batch's "
             "backward (2/3 of a micro-batch alone) less one block's.", "",
             "| link | step, each reduce-scatter waited for | step, left running | saved | reduce-scatters | window | "
             "share of the shorter hidden |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['rate']:g} Gbit/s | {r['off']:.2f} s | {r['on']:.2f} s | {r['off'] - r['on']:.2f} s "
                     f"({r['off'] / r['on']:.2f}×) | {r['reduces']:.2f} s | {r['window']:.2f} s | "
                     f"{r['hidden_share']:.0%} |")
    from cputrain.plan.time import REDUCE_HIDDEN_SHARE

    lines += ["", f"Median share hidden: {median_share:.0%}; the time plan hides {REDUCE_HIDDEN_SHARE:.0%} of the "
              "shorter (cputrain.plan.time.overlap.REDUCE_HIDDEN_SHARE: never more than the window or the transfer). "
              "No core is left to gloo here (2 cores, one rank each): gloo's copies share the core with the backward."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
