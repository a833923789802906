"""Two hosts on this machine: two network namespaces joined by a veth pair, each running the
node side of `cputrain train --nnodes 2`, rendezvousing over that link. Needs root and `ip`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from conftest import REPO, cli_env, tiny_overrides
from dist_helpers import assert_no_survivors, losses

pytestmark = [pytest.mark.slow, pytest.mark.netns]

ADDRS = ("10.77.0.1", "10.77.0.2")  # exist only inside the namespaces this test makes


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed")
    tag = uuid.uuid4().hex[:6]
    names = [f"ct{tag}a", f"ct{tag}b"]
    veths = [f"vc{tag}a", f"vc{tag}b"]
    try:
        for ns in names:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", veths[0], "netns", names[0], "type", "veth", "peer", "name", veths[1], "netns", names[1])
        for ns, veth, addr in zip(names, veths, ADDRS):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
        yield list(zip(names, veths, ADDRS))
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_nodes_over_a_veth_pair(two_hosts, tmp_path, cache_dir):
    out = tmp_path / "run"
    endpoint = f"{ADDRS[0]}:29555"
    procs = []
    for node_rank, (ns, veth, _addr) in enumerate(two_hosts):
        # GLOO_SOCKET_IFNAME: gloo's ranks talk over the link between the hosts.
        env = cli_env(GLOO_SOCKET_IFNAME=veth)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "cputrain", "train",
               *tiny_overrides(out, cache_dir, **{"parallel.strategy": "fsdp", "launch.rdzv_timeout_s": 60}),
               "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "1", "--rdzv-endpoint", endpoint]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    try:
        results = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    assert "2 × 1" in "".join(err for _, err in results)
    assert sorted(losses(out)) == list(range(1, 11))
    assert (out / "model" / "model.safetensors").is_file()
    assert_no_survivors(out)
