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

import argparse
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.network.gloo_link import (ADDRS, WARMUP_STEPS, median_step_s,  # noqa: E402
                                          run_on_each_node, run_settings, shape_link, two_nodes)
from benchmarks.network.model_sizes import MODEL_34M, MODEL_TINY  # noqa: E402

WORLD = 2
MICRO_BATCHES = 4
FSDP = ["parallel.strategy=fsdp", "parallel.layout=full_shard", "parallel.reduce_dtype=fp32"]


def train_two_nodes(names, settings, micro, prefetch: bool, run_dir: Path) -> None:
    port = 29900 + int(uuid.uuid4().int % 90)
    run_on_each_node(names, lambda node: ["-m", "cputrain", "train", *settings, *FSDP,
                                          f"parallel.prefetch={'true' if prefetch else 'false'}",
                                          f"train.global_batch_size={micro * MICRO_BATCHES * WORLD}",
                                          f"output_dir={run_dir}", "launch.rdzv_timeout_s=120", "--nnodes", str(WORLD),
                                          "--node-rank", str(node), "--nproc-per-node", "1",
                                          "--rdzv-endpoint", f"{ADDRS[0]}:{port}"],
                     "2-node fsdp run", 3600)


def alone_s(settings, micro, tmp: Path) -> float:
    from benchmarks.network.fsdp_layouts import train_alone

    run_dir = tmp / "alone"
    train_alone(settings, micro, run_dir)
    return median_step_s(run_dir)


def gather_share(settings, micro, link: float) -> float:
    """The planned share of the network time that is the blocks' gathers (the rest: the root's
    gather and the reduce-scatters, which prefetching cannot hide)."""
    from cputrain.commands.plan import load_run_config
    from cputrain.hardware import detect
    from cputrain.plan.memory.build import make_plan
    from cputrain.plan.time import Compute, Link, StepSettings, plan_step_time
    from cputrain.training.choices import decide_for_plan

    vocab = int(next(s for s in settings if s.startswith("model.tokenizer_vocab_size=")).split("=")[1])
    cfg = load_run_config(None, [*settings, *FSDP, "parallel.prefetch=false",
                                 f"train.global_batch_size={micro * MICRO_BATCHES * WORLD}"])
    cfg = decide_for_plan(cfg, WORLD, vocab_size=vocab).config
    shape = make_plan(cfg, WORLD, nproc_per_node=1, vocab_size=vocab).shape
    hw = detect()
    plan = plan_step_time(StepSettings.of_config(cfg), WORLD, 1, shape,
                          Compute(hw.peak_flops[cfg.hardware.precision] / hw.physical_cores, 0.5),
                          Link(link, gloo_cpu_capped=True))
    gathers = sum(c.seconds for c in plan.collectives if c.kind == "all_gather" and c.what.startswith("blocks"))
    return gathers / plan.network_s * (shape.layers - 1) / shape.layers if plan.network_s else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model, one rate, one repetition: checks the script")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rates", default="0.25,0.5,1", help="link rates in Gbit/s")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    model, seq_len, micro, steps = (MODEL_TINY, 32, 2, 4) if args.quick else (MODEL_34M, 512, 2, 6)
    rates = [1.0] if args.quick else [float(r) for r in args.rates.split(",")]
    reps = 1 if args.quick else args.reps
    rows = []
    with tempfile.TemporaryDirectory(prefix="cputrain-prefetch-") as tmp, two_nodes() as names:
        tmp = Path(tmp)
        settings = run_settings(model, seq_len, micro, steps, tmp / "cache")
        compute_s = alone_s(settings, micro, tmp)
        for rate in rates:
            shape_link(names, rate)
            times = {False: [], True: []}
            for rep in range(reps):
                for prefetch in (False, True):
                    run_dir = tmp / f"{rate:g}-{prefetch}-{rep}"
                    train_two_nodes(names, settings, micro, prefetch, run_dir)
                    times[prefetch].append(median_step_s(run_dir))
            off, on = statistics.median(times[False]), statistics.median(times[True])
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
