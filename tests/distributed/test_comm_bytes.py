"""The bytes cputrain reports as sent by the collectives agree with the kernel's own count.

A 2-rank DDP run inside a fresh network namespace: its loopback carries the run's traffic and
nothing else, so the tx bytes of `lo` in /proc/net/dev (read in that namespace before and
after) are everything the ranks, the agent and the rendezvous store sent. The sum over ranks
of `comm_sent_bytes` (ring all-reduce: each rank sends the same, so twice rank 0's logged
figure) must account for most of it and must not exceed it. The time plan's volume
(cputrain.plan.time.comm_volume: DDP's one all-reduce of the trained gradients a step, FSDP's
gathers and reduce-scatters in the layout the run decided) must match what a step logged.

Tolerance: the kernel count may exceed the metered bytes by 15% (TCP/IP headers, about 1%
on loopback's 64 KiB segments, and gloo's own framing) plus a fixed 4 MiB for what the meter
leaves out on purpose: the rendezvous and store traffic, DDP's start-up comparison of the
weights' fingerprints, the loss all-reduce of evaluation, checkpoint writes and memory.json's gather.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import uuid

import pytest
import yaml

from harness.cli_env import cli_env
from harness.repo import REPO
from harness.tiny_run import tiny_overrides
from harness.warm_client import warm
from dist_helpers import assert_no_survivors

pytestmark = [pytest.mark.slow, pytest.mark.netns]

WORLD = 2
OVERHEAD_FRACTION = 0.15
OVERHEAD_FIXED_BYTES = 4 * 2**20
PLAN_TOLERANCE = 0.03  # the few bytes of each step's loss and stop-flag all-reduces


@pytest.fixture
def namespace():
    if os.geteuid() != 0:
        pytest.skip("making a network namespace needs root")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed")
    name = f"ctb{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, capture_output=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def loopback_tx_bytes(ns: str) -> int:
    """tx bytes of `lo` as the kernel counts them inside namespace `ns`."""
    text = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/dev"], check=True, capture_output=True,
                          text=True).stdout
    for line in text.splitlines():
        iface, _, counters = line.partition(":")
        if iface.strip() == "lo":
            return int(counters.split()[8])  # 8 receive fields, then transmit bytes
    raise AssertionError(f"no lo in /proc/net/dev of {ns}:\n{text}")


def metered_and_kernel_bytes(namespace: str, out, overrides: list[str]) -> tuple[int, int, list[dict]]:
    """Run `overrides` on 2 ranks inside `namespace`: (bytes the ranks' meters counted, bytes the
    kernel counted on its loopback, the rows of metrics.jsonl)."""
    before = loopback_tx_bytes(namespace)
    # The agent a fresh interpreter in the namespace; its ranks forked by the warm rank server, which
    # puts each in its stand-in's namespace (harness/warm_interpreter.py): the same sockets, ~4 s less each.
    proc = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-m", "cputrain", "train", *overrides,
                           "--nproc-per-node", str(WORLD)], cwd=REPO, env=cli_env(**warm().ranks.exec_env()),
                          capture_output=True, text=True, timeout=300)
    after = loopback_tx_bytes(namespace)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_survivors(out)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # every rank's own count: the sum of what each sent is what crossed the loopback
    per_rank = [sum(r["comm_sent_bytes_per_rank"][k] for r in rows if "comm_sent_bytes_per_rank" in r)
                for k in range(WORLD)]
    assert per_rank[0] == sum(r.get("comm_sent_bytes", 0) for r in rows)  # rank 0's row fields are its own
    assert all(n > 0 for n in per_rank), per_rank
    metered = sum(per_rank)
    kernel = after - before
    assert metered > 10 * 2**20, metered  # enough traffic for the comparison to mean something
    limit = metered * (1 + OVERHEAD_FRACTION) + OVERHEAD_FIXED_BYTES
    report = f"metered {metered / 2**20:.2f} MiB, loopback tx {kernel / 2**20:.2f} MiB"
    assert metered <= kernel, f"the meter counts more than went over the wire: {report}"
    assert kernel <= limit, f"traffic the meter does not see: {report} (limit {limit / 2**20:.2f} MiB)"
    return metered, kernel, rows


def test_metered_bytes_match_loopback_counter(namespace, tmp_path, cache_dir):
    out = tmp_path / "run"
    # hidden 128: ~1.4 MB of gradients all-reduced per step, well above the store's chatter
    overrides = tiny_overrides(out, cache_dir, **{
        "model.arch.hidden_size": 128, "model.arch.intermediate_size": 256, "parallel.strategy": "ddp",
        "train.max_steps": 10, "train.micro_batch_size": 2, "train.eval_every": 100,
        "train.checkpoint_every": 100})
    _, _, rows = metered_and_kernel_bytes(namespace, out, overrides)

    # The time plan's figure for the same run: the shape the run planned (plan.json: its real
    # vocabulary), one all-reduce of the trained gradients a step whatever the accumulation (2 here).
    from cputrain.config.file import load_config
    from cputrain.plan.time import comm_pattern
    from cputrain.plan.model_shape import model_shape

    doc = json.loads((out / "plan.json").read_text())
    shape = model_shape(load_config(None, overrides).model, vocab_size=doc["model"]["vocab_size"])
    assert shape.trainable_params == doc["model"]["trainable_parameters"]
    planned = comm_pattern(shape, "ddp", "fp32", WORLD, micro_batches=2).rank_bytes(WORLD)["all_reduce"]
    logged = statistics.median(r["comm_sent_bytes"] for r in rows if "comm_sent_bytes" in r and "loss" in r)
    assert abs(logged - planned) <= PLAN_TOLERANCE * planned, f"a step logged {logged:,} bytes, the plan {planned:,.0f}"


def test_fsdp_reduce_scatters_counted_and_halved(namespace, tmp_path, cache_dir):
    """FSDP over gloo: the meter counts what crossed the loopback with either reduce-scatter
    (gloo's own sends an all-reduce's bytes), and the all-to-all one sends fewer. Each step logged
    what the time plan plans for the layout the run decided (one node: gather_once, the fastest that
fits, and fp32 reduction)."""
    from cputrain.config.file import load_config
    from cputrain.plan.time import comm_pattern
    from cputrain.plan.model_shape import model_shape

    kernel = {}
    for reduce_scatter in ("native", "all_to_all"):
        out = tmp_path / reduce_scatter
        overrides = tiny_overrides(out, cache_dir, **{
            "model.arch.hidden_size": 128, "model.arch.intermediate_size": 256, "parallel.strategy": "fsdp",
            "parallel.reduce_scatter": reduce_scatter, "train.max_steps": 6, "train.micro_batch_size": 2,
            "train.eval_every": 100, "train.checkpoint_every": 100})
        _, kernel[reduce_scatter], rows = metered_and_kernel_bytes(namespace, out, overrides)

        decided = yaml.safe_load((out / "config.yaml").read_text())["parallel"]
        assert (decided["layout"], decided["reduce_dtype"]) == ("gather_once", "fp32")
        doc = json.loads((out / "plan.json").read_text())
        shape = model_shape(load_config(None, overrides).model, vocab_size=doc["model"]["vocab_size"])
        # 8 sequences a step, 2 a micro-batch, 2 ranks: 2 micro-batches per rank
        planned = sum(comm_pattern(shape, "fsdp", "fp32", WORLD, micro_batches=2, layout=decided["layout"],
                                   reduce_dtype="fp32", reduce_scatter=reduce_scatter).rank_bytes(WORLD).values())
        logged = statistics.median(r["comm_sent_bytes"] for r in rows if "comm_sent_bytes" in r and "loss" in r)
        assert abs(logged - planned) <= PLAN_TOLERANCE * planned, \
            f"{reduce_scatter}: a step logged {logged:,} bytes, the plan {planned:,.0f}"
    # gather_once sends each block's parameters once a step and its gradients once: the
    # gradients are about half of what it sends, and halving their bytes saves about a quarter
    assert kernel["all_to_all"] < 0.85 * kernel["native"], kernel
