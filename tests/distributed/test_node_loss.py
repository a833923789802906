"""A node lost in the middle of a run, on two hosts made of network namespaces (root and `ip`).

Node 0 (10.77.0.1) hosts the rendezvous; node 1 (10.77.0.2) is the one lost: (b) its link down for
10 s, then up, and later in the same run (a) all its processes killed with SIGKILL, then started
again; (c) its link down for good. Each case prints the time from the fault to what node 0 does, and the
figures are in docs/guides/faults-and-resume.md. The bounds come from the settings the nodes run
with: a collective waits parallel.timeout_s (20 s; 15 s in (c)) for a silent peer, a restarted group waits
launch.rdzv_timeout_s for every node to rejoin; every run ends with the losses of one straight
run of the same config (2 ranks on one host, trained once).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from safetensors.torch import load_file

from harness.tiny_run import tiny_overrides
from dist_helpers import HOST_ADDRS, Node, kill_netns, losses, netns_pids, set_link, two_hosts

pytestmark = [pytest.mark.slow, pytest.mark.netns]

# 60 steps of ~50 ms, a checkpoint every 5: a fault right after step 10's checkpoint lands with
# 2–3 s of training still ahead.
RUN = {"train.max_steps": 60, "train.checkpoint_every": 5, "train.eval_every": 100, "data.seq_len": 64}
TIMEOUT_S = 20  # parallel.timeout_s: how long a collective waits for a silent peer
START_S = 240  # two fresh interpreters per node, on 2 shared cores: start, rendezvous, first steps


@pytest.fixture(scope="module")
def hosts():
    with two_hosts() as made:
        yield made


@pytest.fixture(scope="module")
def straight(hosts, tmp_path_factory, trained_run):
    """The same run never interrupted: 2 ranks on one host compute the very losses of 1 rank on each
    of two (the same 2-rank all-reduce). After `hosts`, so nothing trains where the cases skip."""
    out = tmp_path_factory.mktemp("straight") / "run"
    trained_run(out, nproc_per_node=2, **RUN)
    return out


def _overrides(out, cache_dir, **launch):
    return tiny_overrides(out, cache_dir, **RUN, **{"parallel.timeout_s": TIMEOUT_S, **launch})


def _start(hosts, out, cache_dir, port, **launch) -> list[Node]:
    # The run folder exists before the nodes start: two nodes probing a missing folder at once
    # could see each other's probe remove it.
    out.mkdir(parents=True, exist_ok=True)
    endpoint = f"{HOST_ADDRS[0]}:{port}"
    return [Node(ns, rank, 2, endpoint, _overrides(out, cache_dir, **launch)) for rank, (ns, _) in enumerate(hosts)]


def _after_checkpoint(out, nodes, step: int = 10) -> None:
    deadline = time.monotonic() + START_S
    while not (out / "checkpoints" / f"step-{step:06d}").is_dir():
        assert time.monotonic() < deadline, f"no checkpoint of step {step} within {START_S} s:\n" + \
            nodes[0].output()[-3000:]
        assert all(n.ended_at is None for n in nodes), "a node ended before the fault:\n" + nodes[0].output()[-3000:]
        time.sleep(0.01)


def _newest_checkpoint(out) -> int:
    return max(int(p.name.split("-")[1]) for p in (out / "checkpoints").iterdir() if p.name[5:].isdigit())


def _same_as_straight(out, straight) -> None:
    got, want = losses(out), losses(straight)
    assert sorted(got) == sorted(want) == list(range(1, RUN["train.max_steps"] + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-6), f"step {step}: {got[step]} vs {want[step]}"
    a = load_file(str(straight / "model" / "model.safetensors"))
    b = load_file(str(out / "model" / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=f"{key} differs from the straight run")


def _finish(hosts, nodes) -> None:
    """Nothing of the run outlives the test, and the link is back up for the next one."""
    for node in nodes:
        if node.ended_at is None:
            node.proc.kill()
    for ns, _ in hosts:
        kill_netns(ns)
        set_link(ns, up=True)


def test_a_link_down_10_s_then_a_node_killed_the_run_goes_on_then_rejoins(hosts, straight, tmp_path, cache_dir):
    """Two faults in one run (one run's start paid once).

    (b) Node 1's link down for 10 s after step 10's checkpoint, less than parallel.timeout_s: the
    collective in flight waits, TCP delivers what was sent once the link is back, and the run goes
    on where it was, no restart, nothing trained again; the time lost is the outage's.
    (a) Then, after step 20's checkpoint, every process of node 1 killed (SIGKILL): the kernel
    closes its sockets, so node 0's next collective fails at once and its rank names node 1; with
    launch.max_restarts=1 node 0's agent waits launch.rdzv_timeout_s for it. Node 1 started again:
    both resume from the newest checkpoint and end with the straight run's losses."""
    out = tmp_path / "run"
    launch = {"launch.max_restarts": 1, "launch.rdzv_timeout_s": 30}
    nodes = _start(hosts, out, cache_dir, 29561, **launch)
    try:
        # (b) the link down for 10 s
        _after_checkpoint(out, nodes)
        set_link(hosts[1][0], up=False)
        down = time.monotonic()
        time.sleep(10)
        set_link(hosts[1][0], up=True)
        up = time.monotonic()
        _after_checkpoint(out, nodes, step=20)
        steps = [t for t, line in list(nodes[0].lines) if "] step " in line and "loss" in line]
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        stalled = max(gaps)
        assert stalled >= up - down - 1.0, f"no step waited for the link ({stalled:.2f} s at most): the fault missed"
        assert "resumed from" not in nodes[0].output(), nodes[0].output()[-3000:]  # it went on: no restart
        print(f"\n(b) link down {up - down:.1f} s: one step took {stalled:.1f} s (the others "
              f"{statistics.median(gaps):.2f} s): {stalled - statistics.median(gaps):.1f} s lost, the run went on; "
              f"the first step after the link came back ended {stalled - (up - down):.2f} s after it")

        # (a) node 1 killed, then started again
        killed = kill_netns(hosts[1][0])
        fault = time.monotonic()
        assert killed, "node 1 had no process to kill"
        named = nodes[0].wait_for_line("stopped: node 1 (10.77.0.2, rank 1) is gone", TIMEOUT_S, since=fault)
        assert named, nodes[0].output()[-3000:]
        assert "the group restarts once every node has rejoined" in named[1], named[1]
        newest = _newest_checkpoint(out)  # nothing is saved once a rank is gone
        assert newest >= 20, f"the newest checkpoint is step {newest}, before the kill's"
        assert nodes[0].ended_at is None, "node 0 ended instead of waiting for node 1:\n" + nodes[0].output()[-3000:]
        restarted = Node(hosts[1][0], 1, 2, f"{HOST_ADDRS[0]}:29561", _overrides(out, cache_dir, **launch))
        nodes.append(restarted)
        resumed = nodes[0].wait_for_line(f"(step {newest})", START_S, since=named[0])
        assert resumed and "resumed from" in resumed[1], nodes[0].output()[-3000:]
        assert nodes[0].wait(START_S) == 0, nodes[0].output()[-3000:]
        assert restarted.wait(60) == 0, restarted.output()[-3000:]
        print(f"(a) node 1 killed after step {newest}'s checkpoint: node 0 named it {named[0] - fault:.2f} s "
              f"after the kill; node 1 started again, the group resumed from step {newest} "
              f"{resumed[0] - fault:.1f} s after the kill")
        for node in nodes[:1] + nodes[2:]:
            assert "Traceback" not in node.output(), node.output()[-3000:]
        _same_as_straight(out, straight)
    finally:
        _finish(hosts, nodes)


@pytest.mark.usefixtures("straight")  # its data cache: no node tokenizes while the other waits
def test_c_node_never_back_both_sides_end_within_the_bound(hosts, tmp_path, cache_dir):
    """Node 1's link down for good, as when its machine is gone: nothing closes the connections,
    so each side's collective times out after parallel.timeout_s and names the other; node 0's
    agent restarts the group (launch.max_restarts=1), waits launch.rdzv_timeout_s for node 1 and
    ends with exit 2 naming it. Node 1, cut off from the rendezvous host, ends too (exit 2)
    instead of waiting on it for ever. The bound: parallel.timeout_s + launch.rdzv_timeout_s and
    a few seconds for the agents: the same 15 s of margin at any settings. Both waits are shorter
    than (a)'s (15 s and 10 s): only (a)'s outage needs parallel.timeout_s long."""
    timeout_s, rdzv_s = 15, 10
    bound_s = timeout_s + rdzv_s + 15
    out = tmp_path / "run"
    nodes = _start(hosts, out, cache_dir, 29563, **{"launch.max_restarts": 1, "launch.rdzv_timeout_s": rdzv_s,
                                                    "parallel.timeout_s": timeout_s})
    try:
        _after_checkpoint(out, nodes)
        set_link(hosts[1][0], up=False)
        fault = time.monotonic()
        named = nodes[0].wait_for_line(f"stopped: node 1 (10.77.0.2, rank 1) did not answer for {timeout_s} s",
                                       timeout_s + 15, since=fault)
        assert named, nodes[0].output()[-3000:]
        assert nodes[0].wait(bound_s - (time.monotonic() - fault)) == 2, nodes[0].output()[-3000:]
        assert nodes[1].wait(max(1.0, bound_s - (time.monotonic() - fault))) == 2, nodes[1].output()[-3000:]
        last0, last1 = nodes[0].last_line(), nodes[1].last_line()
        assert last0.startswith("cputrain: error: node 1 (10.77.0.2, rank 1) was lost") and "did not rejoin" in last0, last0
        assert last1.startswith("cputrain: error: the rendezvous host 10.77.0.1:29563 (node 0) has not answered"), last1
        assert not netns_pids(hosts[1][0]), "a process of node 1 outlived its agent"
        print(f"\n(c) node 1's link down for good: node 0 named it {named[0] - fault:.1f} s after, exited 2 "
              f"{nodes[0].ended_at - fault:.1f} s after; node 1 exited 2 {nodes[1].ended_at - fault:.1f} s after "
              f"(bound {timeout_s} + {rdzv_s} s + the agents' few)")
        for node in nodes:
            assert "Traceback" not in node.output(), node.output()[-3000:]
    finally:
        _finish(hosts, nodes)
