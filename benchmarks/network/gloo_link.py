"""What gloo gets out of a network link, and whether cputrain's time plan predicts a run over it.

Two "nodes" on this machine: two network namespaces joined by a veth pair, each end's egress
shaped by `tc` (a token bucket, `tbf`) to a line rate: 1, 10 and 25 Gbit/s, and no limit (what
the CPUs themselves can push through loopback-like veth). MTU 9000 on the link, as AWS's VPCs
allow between instances (9001). One process per namespace, pinned to its own core, one thread.

Part 1, collectives: all-gather (bf16, as FSDP2 gathers parameters), reduce-scatter (fp32, FSDP2's
reduce dtype) and all-reduce (fp32, DDP's gradient buckets) between the two nodes at message sizes
1–256 MiB (a message = the whole unsharded tensor: an FSDP block's parameters, a DDP bucket).
Time per call is the median of `--reps` calls after a warm-up, timed on rank 0 between barriers.
Efficiency = the ring's bytes per rank (all-reduce 2·(W−1)/W·N, the others (W−1)/W·N; the
counts cputrain's comm meter uses) ÷ time ÷ the line rate. The table goes to docs/benchmarks/network.md
(block `gloo_link`) and, as JSON, to cputrain/plan/time/gloo_link_efficiency.json, which the time plan
(`cputrain plan`) reads.

Part 2, runs (`--part runs`): 2-node `cputrain train` runs (DDP and FSDP, bf16 where the CPU
has it) at each line rate, their step time against the time plan's prediction.

    python benchmarks/network/gloo_link.py                    # both parts (root, `ip` and `tc` needed)
    python benchmarks/network/gloo_link.py --part collectives
    python benchmarks/network/gloo_link.py --quick            # small sizes, one rate: checks the script only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.network.model_sizes import MODEL_34M, MODEL_TINY  # noqa: E402

EFFICIENCY_FILE = REPO / "cputrain" / "plan" / "time" / "gloo_link_efficiency.json"
ADDRS = ("10.78.0.1", "10.78.0.2")
LINK = "gllink"
MTU = 9000
MIB = 2**20
RATES_GBIT_S = (1.0, 10.0, 25.0)
SIZES_MIB = (1, 4, 16, 64, 256)
# reduce_scatter: gloo's own (an all-reduce and a slice); all_to_all: cputrain's reduce-scatter
# (cputrain.parallel.reduce_scatter), what FSDP2 and ZeRO-3 run on gloo
KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
WORLD = 2


def ring_bytes_per_rank(kind: str, message_bytes: int, world: int = WORLD) -> float:
    factor = 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
    return factor * message_bytes


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def two_nodes():
    """Two namespaces joined by a veth pair named LINK on both ends; yields their names."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("needs root, `ip` and `tc` (iproute2) to make network namespaces and shape the link")
    tag = uuid.uuid4().hex[:6]
    names = [f"gl{tag}a", f"gl{tag}b"]
    try:
        for ns in names:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", f"vg{tag}a", "netns", names[0], "type", "veth", "peer", "name", f"vg{tag}b",
            "netns", names[1])
        for ns, end, addr in zip(names, (f"vg{tag}a", f"vg{tag}b"), ADDRS):
            _ip("-n", ns, "link", "set", end, "name", LINK)
            _ip("-n", ns, "link", "set", LINK, "mtu", str(MTU))
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", LINK)
            _ip("-n", ns, "link", "set", LINK, "up")
        yield names
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def shape_link(names: list[str], rate_gbit_s: float | None) -> None:
    """A token bucket on each end's egress (both directions shaped); None removes it."""
    for ns in names:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", LINK, "root"], capture_output=True)
        if rate_gbit_s is None:
            continue
        # The bucket must hold at least one of veth's GSO super-packets (64 KiB) and about a
        # millisecond of the rate, or the shaper itself caps the rate below what is asked.
        burst_bytes = max(256 * 1024, int(rate_gbit_s * 1e9 / 8 / 1000))
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", LINK, "root", "tbf",
                        "rate", f"{rate_gbit_s}gbit", "burst", str(burst_bytes), "latency", "100ms"],
                       check=True, capture_output=True)


def _clean_env(in_namespace: bool = True) -> dict:
    """The environment of a rank: gloo bound to the shaped link inside a namespace (outside, the
    link does not exist and gloo takes loopback)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GLOO_SOCKET_IFNAME")
           and not k.startswith(("PET_", "OMPI_", "PMI_"))}
    env = {**env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return {**env, "GLOO_SOCKET_IFNAME": LINK} if in_namespace else env


# ---- part 1: collectives -------------------------------------------------------------------

def worker(rank: int, port: int, sizes_mib: list[int], reps: int, out: Path | None) -> None:
    """One node's side: times each collective at each size; rank 0 writes {kind: {bytes: s}}."""
    import torch
    import torch.distributed as dist

    from cputrain.parallel.reduce_scatter import AllToAllReduceScatter

    all_to_all = AllToAllReduceScatter()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{ADDRS[0]}:{port}", rank=rank, world_size=WORLD)
    times: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}
    for size_mib in sizes_mib:
        for kind in KINDS:
            dtype = torch.bfloat16 if kind == "all_gather" else torch.float32
            message_bytes = size_mib * MIB
            full = torch.ones(message_bytes // dtype.itemsize, dtype=dtype)
            shard = torch.ones(full.numel() // WORLD, dtype=dtype)

            def call():
                if kind == "all_gather":
                    dist.all_gather_into_tensor(full, shard)
                elif kind == "reduce_scatter":
                    dist.reduce_scatter_tensor(shard, full)
                elif kind == "all_to_all":
                    all_to_all(shard, full, dist.group.WORLD, dist.ReduceOp.SUM)
                else:
                    dist.all_reduce(full)

            call()  # warm-up: connections, buffers
            samples = []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                call()
                samples.append(time.perf_counter() - start)
            times[kind][message_bytes] = statistics.median(samples)
    dist.barrier()
    if rank == 0 and out is not None:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()


def run_on_each_node(names: list[str], argv_for: Callable[[int], list[str]], what: str, timeout_s: float) -> None:
    """Node i's process in namespace i, pinned to core i, all at once; fails with the first's stderr."""
    procs = []
    for node, ns in enumerate(names):
        cmd = ["ip", "netns", "exec", ns, "taskset", "-c", str(node % os.cpu_count()), sys.executable,
               *argv_for(node)]
        procs.append(subprocess.Popen(cmd, env=_clean_env(), cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=timeout_s)
        if p.returncode != 0:
            raise SystemExit(f"{what} failed:\n{err[-3000:]}")


def run_collectives(names: list[str], sizes_mib: list[int], reps: int, tmp: Path) -> dict[str, dict[int, float]]:
    out = tmp / f"times-{uuid.uuid4().hex[:6]}.json"
    port = 29600 + int(uuid.uuid4().int % 300)
    run_on_each_node(names, lambda rank: [__file__, "--worker", str(rank), "--port", str(port), "--sizes",
                                          ",".join(map(str, sizes_mib)), "--reps", str(reps), "--out", str(out)],
                     "collective worker", 1800)
    raw = json.loads(out.read_text())
    return {kind: {int(b): s for b, s in by_size.items()} for kind, by_size in raw.items()}


def collectives(names: list[str], rates: list[float | None], sizes_mib: list[int], reps: int,
                tmp: Path) -> list[dict]:
    rows = []
    for rate in rates:
        shape_link(names, rate)
        times = run_collectives(names, sizes_mib, reps, tmp)
        for kind, by_size in times.items():
            for message_bytes, seconds in sorted(by_size.items()):
                achieved_gbit_s = ring_bytes_per_rank(kind, message_bytes) * 8 / seconds / 1e9
                rows.append({"collective": kind, "link_gbit_s": rate, "message_bytes": message_bytes,
                             "time_s": seconds, "achieved_gbit_s": achieved_gbit_s,
                             "efficiency": achieved_gbit_s / rate if rate else None})
                print(f"{rate or 'no limit'} Gbit/s {kind:14s} {message_bytes // MIB:4d} MiB: {seconds * 1e3:8.1f} ms"
                      f" = {achieved_gbit_s:6.2f} Gbit/s" + (f" ({achieved_gbit_s / rate:.0%})" if rate else ""),
                      flush=True)
    shape_link(names, None)
    return rows


# ---- part 2: runs against the time plan ---------------------------------------------------

WARMUP_STEPS = 2  # steps left out of the median: the first step builds buffers and connections


def run_settings(model: list[str], seq_len: int, micro: int, steps: int, cache: Path) -> list[str]:
    return [*model, f"data.seq_len={seq_len}", "data.max_documents=2000", f"data.cache_dir={cache}",
            f"train.max_steps={steps}", f"train.micro_batch_size={micro}", "train.log_every=1",
            "train.eval_every=100000", "train.checkpoint_every=100000", "train.sample_tokens=0",
            "train.warmup_steps=1", "hardware.threads=1", "hardware.precision=auto"]


def strategy_settings(strategy: str) -> list[str]:
    """The strategy, and for fsdp the layout these runs measure: every block gathered for each
    micro-batch and gradients reduced in fp32 (benchmarks/network/fsdp_layouts.py runs the others)."""
    extra = ["parallel.layout=full_shard", "parallel.reduce_dtype=fp32"] if strategy == "fsdp" else []
    return [f"parallel.strategy={strategy}", *extra]


def median_step_s(run_dir: Path, key: str = "step_time_s") -> float:
    """The median of a per-step figure of metrics.jsonl (rank 0) over the steps after the warm-up."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    values = [r.get(key, 0.0) for r in rows if "step_time_s" in r and r.get("step", 0) > WARMUP_STEPS]
    return statistics.median(values)


def train_alone(settings: list[str], micro: int, strategy: str, run_dir: Path) -> None:
    """One rank of `strategy` on core 0, no network: the compute (and the strategy's own work on
    the rank: FSDP2's casts and copies, DDP's buckets) the 2-node runs add the network to."""
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "cputrain", "train", *settings,
           f"train.global_batch_size={micro}", *strategy_settings(strategy), f"output_dir={run_dir}"]
    proc = subprocess.run(cmd, env=_clean_env(in_namespace=False), cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def train_one_rank_per_node(names: list[str], overrides: list[str], run_dir: Path, what: str) -> None:
    """`cputrain train` with `overrides`: node i in namespace i on core i, one rank each, rendezvous
    over the shaped link."""
    port = 29900 + int(uuid.uuid4().int % 90)
    run_on_each_node(names, lambda node: ["-m", "cputrain", "train", *overrides, f"output_dir={run_dir}",
                                          "launch.rdzv_timeout_s=120", "--nnodes", str(len(names)),
                                          "--node-rank", str(node), "--nproc-per-node", "1",
                                          "--rdzv-endpoint", f"{ADDRS[0]}:{port}"], what, 3600)


def train_two_nodes(names: list[str], settings: list[str], micro: int, strategy: str, run_dir: Path) -> None:
    train_one_rank_per_node(names, [*settings, f"train.global_batch_size={micro * WORLD}",
                                    *strategy_settings(strategy)], run_dir, f"2-node {strategy} run")


def off_and_on_args(doc: str, rates: str) -> argparse.Namespace:
    """The arguments of a benchmark that runs one setting off and on over the shaped link."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a tiny model, one rate, one repetition: checks the script")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rates", default=rates, help="link rates in Gbit/s")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    # the run's shape (a ~34M Llama, or a tiny one that checks the script), its rates and repetitions
    args.model, args.seq_len, args.micro, args.steps = (MODEL_TINY, 32, 2, 4) if args.quick else (MODEL_34M, 512, 2, 6)
    args.rate_list = [1.0] if args.quick else [float(r) for r in args.rates.split(",")]
    args.reps = 1 if args.quick else args.reps
    return args


def off_and_on_steps(names: list[str], rate: float, reps: int, tmp: Path,
                     train: Callable[[bool, Path], None]) -> tuple[float, float]:
    """The link shaped to `rate`, `train(on, run_dir)` off then on, `reps` times alternated: the
    median step of each setting's runs (the median of their steps after the warm-up)."""
    shape_link(names, rate)
    times = {False: [], True: []}
    for rep in range(reps):
        for on in (False, True):
            run_dir = tmp / f"{rate:g}-{on}-{rep}"
            train(on, run_dir)
            times[on].append(median_step_s(run_dir))
    return statistics.median(times[False]), statistics.median(times[True])


def plan_at_half_peak(overrides: list[str], world: int, link_gbit_s: float):
    """cputrain's time plan of `overrides` on `world` nodes of one rank, each at half its core's
    peak (only the shares of the network time are read from it), and the model's shape."""
    from cputrain.commands.plan import load_run_config
    from cputrain.hardware import detect
    from cputrain.plan.memory.build import make_plan
    from cputrain.plan.time import Compute, Link, StepSettings, plan_step_time
    from cputrain.training.choices import decide_for_plan

    vocab = int(next(s for s in overrides if s.startswith("model.tokenizer_vocab_size=")).split("=")[1])
    cfg = decide_for_plan(load_run_config(None, overrides), world, vocab_size=vocab).config
    shape = make_plan(cfg, world, nproc_per_node=1, vocab_size=vocab).shape
    hw = detect()
    plan = plan_step_time(StepSettings.of_config(cfg), world, 1, shape,
                          Compute(hw.peak_flops[cfg.hardware.precision] / hw.physical_cores, 0.5),
                          Link(link_gbit_s, gloo_cpu_capped=True))
    return plan, shape


def step_plan(settings: list[str], strategy: str, world: int, link_gbit_s: float | None, mfu: float):
    """cputrain's time plan of these run settings on this machine: one core per rank, `world`
    nodes of one rank each."""
    from cputrain.plan.memory.build import make_plan
    from cputrain.commands.plan import load_run_config
    from cputrain.plan.time import Compute, Link, StepSettings, plan_step_time, rank_peak_flops
    from cputrain.training.choices import decide_for_plan

    micro = int(next(s for s in settings if s.startswith("train.micro_batch_size=")).split("=")[1])
    vocab = int(next(s for s in settings if s.startswith("model.tokenizer_vocab_size=")).split("=")[1])
    cfg = load_run_config(None, [*settings, *strategy_settings(strategy),
                                 f"train.global_batch_size={micro * world}"])
    cfg = decide_for_plan(cfg, world, vocab_size=vocab).config
    shape = make_plan(cfg, world, nproc_per_node=1, vocab_size=vocab).shape
    compute = Compute(rank_peak_flops(cfg.hardware.precision, threads=1), mfu, "measured here: the same rank's step alone")
    return plan_step_time(StepSettings.of_config(cfg), world, 1, shape, compute, Link(link_gbit_s, gloo_cpu_capped=True))


def runs(names: list[str], rates: list[float], quick: bool, tmp: Path) -> list[dict]:
    model, seq_len, micro, steps = (MODEL_TINY, 32, 2, 4) if quick else (MODEL_34M, 512, 2, 10)
    settings = run_settings(model, seq_len, micro, steps, tmp / "cache")
    rows = []
    for strategy in ("ddp", "fsdp"):
        alone = tmp / f"alone-{strategy}"
        train_alone(settings, micro, strategy, alone)
        alone_step_s = median_step_s(alone)
        # the share of one core's peak the strategy's rank reached alone: the compute the plan is given
        mfu = step_plan(settings, "single", 1, None, 1.0).compute_s / alone_step_s
        for rate in rates:
            shape_link(names, rate)
            run_dir = tmp / f"{strategy}-{rate:g}"
            train_two_nodes(names, settings, micro, strategy, run_dir)
            measured_s = median_step_s(run_dir)
            plan = step_plan(settings, strategy, WORLD, rate, mfu)
            rows.append({"strategy": strategy, "link_gbit_s": rate, "measured_step_s": measured_s,
                         "measured_comm_s": median_step_s(run_dir, "comm_time_s"),
                         "alone_step_s": alone_step_s, "mfu": mfu, "planned_step_s": plan.step_s,
                         "planned_network_s": plan.network_s, "planned_exposed_s": plan.exposed_network_s,
                         "link_bytes": sum(plan.link_bytes_by_kind.values())})
            print(f"{strategy} at {rate:g} Gbit/s: step {measured_s:.2f} s, planned {plan.step_s:.2f} s "
                  f"(network {plan.network_s:.2f} s, exposed {plan.exposed_network_s:.2f} s; alone "
                  f"{alone_step_s:.2f} s)", flush=True)
    shape_link(names, None)
    return rows


def write_collectives(rows: list[dict], sizes_mib: list[int], reps: int) -> None:
    from benchmarks.runner.blocks import write_block
    from benchmarks.runner.machine import machine_line

    machine = machine_line()
    shaped = [r for r in rows if r["link_gbit_s"]]
    unshaped = [r for r in rows if not r["link_gbit_s"]]
    EFFICIENCY_FILE.write_text(json.dumps({
        "machine": machine.removeprefix("Machine: ").split("; torch")[0],
        "measured": time.strftime("%Y-%m-%d"),
        "how": "benchmarks/network/gloo_link.py: gloo between two network namespaces over a veth pair shaped by tc tbf, "
               f"MTU {MTU}, one rank per namespace, one core and thread each, median of {reps} calls",
        "rows": [{k: r[k] for k in ("collective", "link_gbit_s", "message_bytes", "efficiency")} for r in shaped],
        "cpu_cap_rows": [{"collective": r["collective"], "message_bytes": r["message_bytes"],
                          "gbit_s": r["achieved_gbit_s"]} for r in unshaped],
    }, indent=1) + "\n")
    rates = sorted({r["link_gbit_s"] for r in rows}, key=lambda r: (r is not None, r or 0))
    lines = [machine, "",
             "gloo between two network namespaces joined by a veth pair (MTU 9000), each end's egress shaped by "
             "`tc` tbf to the line rate; one rank per namespace, each pinned to its own core, one thread; "
             f"median of {reps} calls after a warm-up. Efficiency = the ring's bytes per rank (all-reduce "
             "2·(W−1)/W·N, all-gather and reduce-scatter (W−1)/W·N, W = 2) ÷ time ÷ line rate; \"no limit\" "
             "gives the Gbit/s the CPUs reach unshaped. All-gather in bf16 (FSDP2's parameters), reduce-scatter "
             "(gloo's own, an all-reduce and a slice; and cputrain's all-to-all one) and all-reduce in fp32 "
             "(FSDP2's gradient reduction, DDP's buckets). `python benchmarks/network/gloo_link.py "
             "--part collectives`; the shaped rows are also cputrain/plan/time/gloo_link_efficiency.json, which "
             "`cputrain plan` reads.", "",
             "| collective | message | " + " | ".join(f"{r:g} Gbit/s" if r else "no limit" for r in rates) + " |",
             "| --- | ---: |" + " ---: |" * len(rates)]
    for kind in KINDS:
        for size_mib in sizes_mib:
            cells = []
            for rate in rates:
                row = next(r for r in rows if r["collective"] == kind and r["link_gbit_s"] == rate
                           and r["message_bytes"] == size_mib * MIB)
                cells.append(f"{row['achieved_gbit_s']:.2f} Gbit/s" if rate is None
                             else f"{row['efficiency']:.0%} ({row['time_s'] * 1e3:,.0f} ms)")
            lines.append(f"| {kind.replace('_', '-')} | {size_mib} MiB | " + " | ".join(cells) + " |")
    lines += model_check_lines(rows, sizes_mib)
    write_block("gloo_link", "\n".join(lines))


def model_check_lines(rows: list[dict], sizes_mib: list[int]) -> list[str]:
    """The time plan's efficiency (cputrain.plan.time.link_efficiency: the slowest rate's share, capped by
    the unshaped Gbit/s) against what was measured at the faster rates."""
    from cputrain.plan.time import load_table

    table = load_table(EFFICIENCY_FILE)
    rates = sorted({r["link_gbit_s"] for r in rows if r["link_gbit_s"]})
    if table is None or not table.cpu_caps or len(rates) < 2:
        return []
    lines = ["", f"The plan's model of these rows: the share gloo reaches at {rates[0]:g} Gbit/s (its protocol: the CPU "
             "is not the limit there), capped by the Gbit/s it reaches unshaped (the CPU's limit). Measured ÷ "
             "modelled efficiency at the faster rates:", "",
             "| collective | " + " | ".join(f"{m} MiB" for m in sizes_mib) + " |",
             "| --- |" + " ---: |" * len(sizes_mib)]
    ratios = []
    for rate in rates[1:]:
        for kind in KINDS:
            cells = []
            for size_mib in sizes_mib:
                row = next(r for r in rows if r["collective"] == kind and r["link_gbit_s"] == rate
                           and r["message_bytes"] == size_mib * MIB)
                ratio = row["efficiency"] / table.efficiency(kind, size_mib * MIB, rate)
                ratios.append((ratio, size_mib))
                cells.append(f"{ratio:.2f}")
            lines.append(f"| {kind.replace('_', '-')} at {rate:g} Gbit/s | " + " | ".join(cells) + " |")
    every = [r for r, _ in ratios]
    big = [r for r, size_mib in ratios if size_mib >= 64]
    lines += ["", f"Measured ÷ modelled: {min(every):.2f}–{max(every):.2f} over every size, "
              f"{min(big):.2f}–{max(big):.2f} at 64 MiB and above (FSDP's block messages, DDP's buckets are 25 MiB)."]
    return lines


def write_runs(rows: list[dict], quick: bool) -> None:
    from benchmarks.runner.blocks import write_block
    from benchmarks.runner.machine import machine_line

    alone = {r["strategy"]: (r["alone_step_s"], r["mfu"]) for r in rows}
    lines = [machine_line(), "",
             f"2-node `cputrain train` runs over the shaped link ({'tiny smoke model' if quick else '~34M Llama'}, "
             "one rank per namespace on its own core, one thread, precision auto, micro-batch 2 × 512 tokens, one "
             f"micro-batch per rank per step), median step time of the steps after the {WARMUP_STEPS} first, against "
             "`cputrain plan`'s time plan (cputrain/plan/time/step_time.py) of the same settings, as planned for this "
             "machine (`gloo_cpu_capped`: the efficiency capped by what gloo reached unshaped). The plan is given the "
             "compute: the MFU of one rank of the same strategy run alone on one core, no network ("
             + ", ".join(f"{k} {v[0]:.2f} s a step, {v[1]:.1%} of the core's peak" for k, v in alone.items())
             + "); the network time, its overlap and the efficiency (the table above) are the plan's own; "
             "\"in collectives\" is what the run's comm meter logged (comm_time_s). "
             "`python benchmarks/network/gloo_link.py --part runs`.", "",
             "| strategy | link | bytes through the link / step | planned network (exposed) | planned step | "
             "measured step | in collectives | measured ÷ planned |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = r["measured_step_s"] / r["planned_step_s"]
        lines.append(f"| {r['strategy']} | {r['link_gbit_s']:g} Gbit/s | {r['link_bytes'] / MIB:,.0f} MiB | "
                     f"{r['planned_network_s']:.2f} s ({r['planned_exposed_s']:.2f} s) | {r['planned_step_s']:.2f} s | "
                     f"{r['measured_step_s']:.2f} s | {r['measured_comm_s']:.2f} s | {ratio:.2f} |")
    within = [abs(r["measured_step_s"] / r["planned_step_s"] - 1) <= 0.2 for r in rows]
    lines += ["", f"Within ±20%: {sum(within)} of {len(rows)} runs."]
    write_block("gloo_link-runs", "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=3, help="timed calls per collective and size (median; default 3)")
    ap.add_argument("--part", choices=("collectives", "runs", "all"), default="all")
    ap.add_argument("--quick", action="store_true", help="small sizes, one rate, one repetition")
    ap.add_argument("--rates", help="line rates in Gbit/s, comma-separated, 0 = no limit (default: 0,1,10,25)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs and the efficiency file alone")
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.port, [int(s) for s in args.sizes.split(",")], args.reps, args.out)
        return
    import tempfile

    rates: list[float | None] = [10.0] if args.quick else [None, *RATES_GBIT_S]
    if args.rates:
        rates = [float(r) or None for r in args.rates.split(",")]
    sizes = [1, 4] if args.quick else list(SIZES_MIB)
    reps = 1 if args.quick else args.reps
    with tempfile.TemporaryDirectory(prefix="cputrain-gloo-link-") as tmp, two_nodes() as names:
        if args.part in ("collectives", "all"):
            rows = collectives(names, rates, sizes, reps, Path(tmp))
            if not args.no_write:
                write_collectives(rows, sizes, reps)
        if args.part in ("runs", "all"):
            run_rows = runs(names, [r for r in rates if r] or list(RATES_GBIT_S), args.quick, Path(tmp))
            if not args.no_write:
                write_runs(run_rows, args.quick)


if __name__ == "__main__":
    main()
