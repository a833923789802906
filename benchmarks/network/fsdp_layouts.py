"""Each FSDP layout over a shaped link, in the seeds' regime: the network most of today's step.

    python benchmarks/network/fsdp_layouts.py [--quick]

The 8B case cputrain's plan is asked about (configs/llama3-8b-fsdp.yaml on 4 nodes of 2 ranks) spends
69% of its step waiting on the network with FSDP2 as it was built before layouts (every block
gathered for each micro-batch's forward and again for its backward, gradients reduce-scattered by
gloo's all-reduce). This machine cannot run that model, so it runs the same regime: two network
namespaces joined by a veth pair shaped by `tc` (benchmarks/network/gloo_link.py's), 2 ranks in each
(both on the namespace's one core: 2 cores in all), a ~34M Llama in bf16 where the CPU has it, and
a link rate chosen so that the time plan gives that layout the seeds' share of network (≈ 70%).

Then every layout runs over that link, and its measured step (median after the first steps) is set
against the time plan's figure for it. The plan is given the compute it cannot know: the MFU of one
FSDP rank of the same shape run alone on one core (nothing to communicate, FSDP2's own casts and
copies included; the same micro-batches), shared by the node's 2 ranks; the network time, the
efficiency of each collective (gloo_link's table), gloo's CPU time and the node's own collectives
over loopback are the plan's own. The single strategy alone is run too, to say what FSDP2's own
work costs a rank. Writes block `fsdp_layouts` of docs/benchmarks/network.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.network.gloo_link import (ADDRS, WARMUP_STEPS, _clean_env,  # noqa: E402
                                          median_step_s, run_on_each_node, run_settings, shape_link, two_nodes)
from benchmarks.network.model_sizes import MODEL_34M, MODEL_TINY  # noqa: E402

NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE
MICRO_BATCHES = 4  # per rank per step: what gather_once and hybrid save grows with it
TARGET_SHARE = 0.70  # the seeds' case: network 69% of the step, FSDP as built before layouts
# FSDP as built before layouts: every block gathered as it begins, gloo's reduce-scatter, fp32
TODAY = {"parallel.layout": "full_shard", "parallel.reduce_scatter": "native", "parallel.reduce_dtype": "fp32",
         "parallel.prefetch": "false"}
# what a layout runs with now: the all-to-all reduce-scatter, each block's gather issued one block ahead
NOW = {**TODAY, "parallel.reduce_scatter": "all_to_all", "parallel.prefetch": "true"}
CASES = [
    ("full_shard, gloo's reduce-scatter, no prefetch (as before layouts)", TODAY),
    ("full_shard", NOW),
    ("node_reshard", {**NOW, "parallel.layout": "node_reshard"}),
    ("gather_once", {**NOW, "parallel.layout": "gather_once"}),
    ("hybrid", {**NOW, "parallel.layout": "hybrid"}),
    ("gather_once, bf16 reduction", {**NOW, "parallel.layout": "gather_once", "parallel.reduce_dtype": "bf16"}),
    ("hybrid, bf16 reduction", {**NOW, "parallel.layout": "hybrid", "parallel.reduce_dtype": "bf16"}),
]


def overrides(case: dict) -> list[str]:
    return [f"{k}={v}" for k, v in case.items()]


# one rank alone, nothing to communicate: FSDP2 on a world of one still casts, copies and reduces
ALONE = {"single": ["parallel.strategy=single"],
         "fsdp": ["parallel.strategy=fsdp", *overrides(NOW), "--nproc-per-node", "1"]}


def train_alone(settings: list[str], micro: int, strategy: str, run_dir: Path) -> None:
    """One rank of `strategy` on core 0, the same micro-batches a layout's rank takes."""
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "cputrain", "train", *settings,
           f"train.global_batch_size={micro * MICRO_BATCHES}", *ALONE[strategy], f"output_dir={run_dir}"]
    proc = subprocess.run(cmd, env=_clean_env(in_namespace=False), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def train_two_nodes(names: list[str], settings: list[str], micro: int, case: dict, run_dir: Path) -> None:
    """Node i in namespace i, its 2 ranks on core i, rendezvous over the shaped link."""
    port = 29700 + int(uuid.uuid4().int % 90)
    run_on_each_node(names, lambda node: ["-m", "cputrain", "train", *settings, *overrides(case),
                                          f"train.global_batch_size={micro * MICRO_BATCHES * WORLD}",
                                          "parallel.strategy=fsdp", f"output_dir={run_dir}",
                                          "launch.rdzv_timeout_s=120", "--nnodes", str(NODES),
                                          "--node-rank", str(node), "--nproc-per-node", str(RANKS_PER_NODE),
                                          "--rdzv-endpoint", f"{ADDRS[0]}:{port}"],
                     f"2-node fsdp run ({case})", 3600)


def planned(settings: list[str], case: dict, link_gbit_s: float | None, mfu: float):
    """The time plan of `case` on 2 nodes of 2 ranks, each rank half of one core of this machine."""
    from cputrain.commands.plan import load_run_config
    from cputrain.hardware import detect
    from cputrain.plan.memory.build import make_plan
    from cputrain.plan.time import Compute, Link, StepSettings, plan_step_time
    from cputrain.training.choices import decide_for_plan

    micro = int(next(s for s in settings if s.startswith("train.micro_batch_size=")).split("=")[1])
    vocab = int(next(s for s in settings if s.startswith("model.tokenizer_vocab_size=")).split("=")[1])
    cfg = load_run_config(None, [*settings, *overrides(case), "parallel.strategy=fsdp",
                                 f"train.global_batch_size={micro * MICRO_BATCHES * WORLD}"])
    cfg = decide_for_plan(cfg, WORLD, vocab_size=vocab).config
    shape = make_plan(cfg, WORLD, nproc_per_node=RANKS_PER_NODE, vocab_size=vocab).shape
    hw = detect()
    # two ranks share one core: each has half of one core's peak
    peak = hw.peak_flops[cfg.hardware.precision] / hw.physical_cores / RANKS_PER_NODE
    # a veth pair: no per-flow cap (EC2's is the plan's for instances, not this link's)
    return plan_step_time(StepSettings.of_config(cfg), WORLD, RANKS_PER_NODE, shape,
                          Compute(peak, mfu, "measured here: one FSDP rank alone on one core"),
                          Link(link_gbit_s, gloo_cpu_capped=True, rank_core_share=1 / RANKS_PER_NODE))


def regime_link(settings: list[str], mfu: float) -> float:
    """The link rate at which the plan gives the layout as built before layouts TARGET_SHARE of its step."""
    low, high = 0.01, 100.0  # Gbit/s
    for _ in range(40):
        mid = (low * high) ** 0.5
        share = planned(settings, TODAY, mid, mfu).network_share
        low, high = (mid, high) if share > TARGET_SHARE else (low, mid)
    return round((low * high) ** 0.5, 3)


def measure(quick: bool, tmp: Path) -> tuple[float, float, dict[str, float], list[dict]]:
    model, seq_len, micro, steps = (MODEL_TINY, 32, 2, 4) if quick else (MODEL_34M, 512, 2, 6)
    settings = run_settings(model, seq_len, micro, steps, tmp / "cache")
    alone_s = {}
    for strategy in ALONE:
        train_alone(settings, micro, strategy, tmp / f"alone-{strategy}")
        alone_s[strategy] = median_step_s(tmp / f"alone-{strategy}")
    # the share of one core's peak the FSDP rank reached alone: a plan of its step at MFU 1, ÷ measured
    from cputrain.hardware import detect

    one_core = detect()
    mfu = planned_single(settings, micro, one_core) / alone_s["fsdp"]
    link = regime_link(settings, mfu)
    rows = []
    with two_nodes() as names:
        shape_link(names, link)
        for name, case in CASES:
            run_dir = tmp / f"run-{len(rows)}"
            train_two_nodes(names, settings, micro, case, run_dir)
            measured = median_step_s(run_dir)
            plan = planned(settings, case, link, mfu)
            rows.append({"layout": name, "measured_step_s": measured, "planned_step_s": plan.step_s,
                         "planned_share": plan.network_share, "link_bytes": sum(plan.link_bytes_by_kind.values()),
                         "in_node_s": plan.in_node_s,
                         "comm_s": median_step_s(run_dir, "comm_time_s")})
            print(f"{name}: measured {measured:.2f} s, planned {plan.step_s:.2f} s (network "
                  f"{plan.network_share:.0%})", flush=True)
        shape_link(names, None)
    return link, mfu, alone_s, rows


def planned_single(settings: list[str], micro: int, hw) -> float:
    """The compute seconds of one rank's step at MFU 1 on one core (the alone runs' shape: the same
    FLOPs under FSDP on a world of one as under the single strategy)."""
    from cputrain.commands.plan import load_run_config
    from cputrain.plan.memory.build import make_plan
    from cputrain.plan.time import Compute, StepSettings, plan_step_time
    from cputrain.training.choices import decide_for_plan

    vocab = int(next(s for s in settings if s.startswith("model.tokenizer_vocab_size=")).split("=")[1])
    cfg = load_run_config(None, [*settings, "parallel.strategy=single",
                                 f"train.global_batch_size={micro * MICRO_BATCHES}"])
    cfg = decide_for_plan(cfg, 1, vocab_size=vocab).config
    shape = make_plan(cfg, 1, nproc_per_node=1, vocab_size=vocab).shape
    peak = hw.peak_flops[cfg.hardware.precision] / hw.physical_cores
    return plan_step_time(StepSettings.of_config(cfg), 1, 1, shape, Compute(peak, 1.0)).compute_s


def write(link: float, mfu: float, alone_s: dict[str, float], rows: list[dict], quick: bool) -> None:
    from benchmarks.runner.blocks import write_block
    from benchmarks.runner.machine import machine_line

    today = rows[0]["measured_step_s"]
    lines = [machine_line(), "",
             f"`python benchmarks/network/fsdp_layouts.py`: 2 network namespaces × 2 ranks (each namespace's ranks on its one "
             f"core, one thread each), {'a tiny smoke model' if quick else 'a ~34M Llama'}, precision auto, "
             f"{MICRO_BATCHES} micro-batches per rank per step, over a veth link shaped by `tc` to {link:g} Gbit/s: the "
             f"rate at which the time plan gives FSDP as built before layouts {TARGET_SHARE:.0%} of its step on the "
             "network (the seeds' 8B case: 69%). The plan is given the compute (one FSDP rank alone on one core, "
             f"nothing to communicate, reached {mfu:.1%} of the core's peak; a node's 2 ranks share it) and plans the "
             "rest itself: the link's time, gloo's CPU time and the node's own collectives over loopback, each rank "
             f"with half a core. Median step of the steps after the {WARMUP_STEPS} first. One rank alone: "
             f"{alone_s['fsdp']:.2f} s a step under FSDP, {alone_s['single']:.2f} s under the single strategy "
             f"(FSDP2's own work on a rank: {alone_s['fsdp'] / alone_s['single']:.2f}×).", "",
             "| layout | bytes through the link / step (plan) | planned: in the node | planned network share | "
             "planned step | measured step | measured ÷ planned | speed-up over as before |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['link_bytes'] / 2**20:,.0f} MiB | {r['in_node_s']:.2f} s | "
                     f"{r['planned_share']:.0%} | "
                     f"{r['planned_step_s']:.2f} s | {r['measured_step_s']:.2f} s | "
                     f"{r['measured_step_s'] / r['planned_step_s']:.2f} | {today / r['measured_step_s']:.2f}× |")
    within = sum(abs(r["measured_step_s"] / r["planned_step_s"] - 1) <= 0.2 for r in rows)
    best = min(rows, key=lambda r: r["measured_step_s"])
    lines += ["", f"Within ±20% of the plan: {within} of {len(rows)} layouts. Best: {best['layout']}, "
              f"{today / best['measured_step_s']:.2f}× the step as before layouts."]
    write_block("fsdp_layouts", "\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model, few steps: checks the script only")
    ap.add_argument("--no-write", action="store_true", help="print, do not write the block")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="cputrain-fsdp-layouts-") as tmp:
        link, mfu, alone_s, rows = measure(args.quick, Path(tmp))
    if args.no_write:
        print(json.dumps({"link_gbit_s": link, "mfu": mfu, "alone_s": alone_s, "rows": rows}, indent=1))
        return
    write(link, mfu, alone_s, rows, args.quick)


if __name__ == "__main__":
    main()
