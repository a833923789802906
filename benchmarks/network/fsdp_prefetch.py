"""Does FSDP2's prefetch hide a block's gather on CPU, with gloo's thread sharing the core?

    python benchmarks/network/fsdp_prefetch.py [--quick]

Two network namespaces joined by a veth pair shaped by `tc` (benchmarks/network/gloo_link.py's), one
rank in each on its own core, one thread (the compute takes the whole core: no core is left to
gloo). A ~34M Llama, FSDP full_shard, bf16 where the CPU has it, at link rates where the network
is about half, once and twice the compute; each rate with parallel.prefetch=false (a block's
gather issued as the block begins) and =true (issued one block ahead, asynchronously), alternated,
median step of the steps after the first two, medians of the repetitions.

The share hidden is what prefetching saved over the shorter of the two things that could overlap:
the blocks' gathers (the plan's share of the network time, of the measured network time: the step
without prefetch less one rank's compute alone) and the compute (one rank of the single strategy
alone on one core, the same micro-batches). The time plan takes its median
(cputrain.plan.time.overlap.PREFETCH_HIDDEN_SHARE). Writes block `fsdp_prefetch` of
docs/benchmarks/network.md.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.network.gloo_link import (WARMUP_STEPS, off_and_on_args, off_and_on_steps, median_step_s, plan_at_half_peak,  # noqa: E402
                                          run_settings, shape_link, train_one_rank_per_node, two_nodes)

WORLD = 2
MICRO_BATCHES = 4
FSDP = ["parallel.strategy=fsdp", "parallel.layout=full_shard", "parallel.reduce_dtype=fp32"]


def train_two_nodes(names, settings, micro, prefetch: bool, run_dir: Path) -> None:
    train_one_rank_per_node(names, [*settings, *FSDP, f"parallel.prefetch={'true' if prefetch else 'false'}",
                                    f"train.global_batch_size={micro * MICRO_BATCHES * WORLD}"],
                            run_dir, "2-node fsdp run")


def alone_s(settings, micro, tmp: Path) -> float:
    """One rank of the single strategy alone on one core, the same micro-batches."""
    from benchmarks.network.fsdp_layouts import train_alone

    run_dir = tmp / "alone"
    train_alone(settings, micro, "single", run_dir)
    return median_step_s(run_dir)


def gather_share(settings, micro, link: float) -> float:
    """The planned share of the network time that is the blocks' gathers (the rest: the root's
    gather and the reduce-scatters, which prefetching cannot hide)."""
    plan, shape = plan_at_half_peak([*settings, *FSDP, "parallel.prefetch=false",
                                     f"train.global_batch_size={micro * MICRO_BATCHES * WORLD}"], WORLD, link)
    gathers = sum(c.seconds for c in plan.collectives if c.kind == "all_gather" and c.what.startswith("blocks"))
    return gathers / plan.network_s * (shape.layers - 1) / shape.layers if plan.network_s else 0.0


def main() -> None:
    args = off_and_on_args(__doc__, "0.25,0.5,1")
    seq_len, micro, reps = args.seq_len, args.micro, args.reps
    rows = []
    with tempfile.TemporaryDirectory(prefix="cputrain-prefetch-") as tmp, two_nodes() as names:
        tmp = Path(tmp)
        settings = run_settings(args.model, seq_len, micro, args.steps, tmp / "cache")
        compute_s = alone_s(settings, micro, tmp)
        for rate in args.rate_list:
            off, on = off_and_on_steps(names, rate, reps, tmp, lambda prefetch, run_dir: train_two_nodes(
                names, settings, micro, prefetch, run_dir))
            gathers_s = max(0.0, off - compute_s) * gather_share(settings, micro, rate)
            shorter = min(gathers_s, compute_s)
            rows.append({"rate": rate, "off": off, "on": on, "compute": compute_s, "gathers": gathers_s,
                         "hidden_share": (off - on) / shorter if shorter > 0 else 0.0})
            print(rows[-1], flush=True)
        shape_link(names, None)
    from benchmarks.runner.blocks import write_block
    from benchmarks.runner.machine import machine_line

    median_share = statistics.median(r["hidden_share"] for r in rows)
    lines = [machine_line(), "",
             f"`python benchmarks/network/fsdp_prefetch.py`: 2 network namespaces, one rank each on its own core, one thread, "
             f"{'a tiny smoke model' if args.quick else 'a ~34M Llama'}, FSDP full_shard, precision auto, "
             f"{MICRO_BATCHES} micro-batches per rank per step, over a veth link shaped by `tc`; median step of the "
             f"steps after the {WARMUP_STEPS} first, median of {reps} alternated runs. Compute: one rank of the single "
             f"strategy alone on one core, {compute_s:.2f} s a step. The blocks' gathers: the measured network time "
             "(the step without prefetch less the compute) times the plan's share of it that is the blocks' gathers "
             "after the first of each pass.", "",
             "| link | step, gathers as blocks begin | step, gathers a block ahead | saved | blocks' gathers | "
             "share of the shorter (gathers, compute) hidden |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['rate']:g} Gbit/s | {r['off']:.2f} s | {r['on']:.2f} s | {r['off'] - r['on']:.2f} s "
                     f"({r['off'] / r['on']:.2f}×) | {r['gathers']:.2f} s | {r['hidden_share']:.0%} |")
    lines += ["", f"Median share hidden: {median_share:.0%} (the time plan's PREFETCH_HIDDEN_SHARE). No core is left "
              "to gloo here (2 cores, one rank each): where one is, more may hide."]
    if args.no_write:
        print("\n".join(lines))
        return
    write_block("fsdp_prefetch", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
