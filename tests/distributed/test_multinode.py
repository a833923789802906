"""Two hosts on this machine: two network namespaces joined by a veth pair, each running the
node side of `cputrain train --nnodes 2`, rendezvousing over that link. Needs root and `ip`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.cli_env import cli_env
from harness.repo import REPO
from harness.tiny_run import tiny_overrides
from dist_helpers import HOST_ADDRS, HOST_LINK, assert_no_survivors, losses, two_hosts

pytestmark = [pytest.mark.slow, pytest.mark.netns]


@pytest.fixture
def hosts():
    with two_hosts() as made:
        yield made


def test_two_nodes_over_a_veth_pair(hosts, tmp_path, cache_dir):
    out = tmp_path / "run"
    endpoint = f"{HOST_ADDRS[0]}:29555"
    procs = []
    for node_rank, (ns, _addr) in enumerate(hosts):
        # GLOO_SOCKET_IFNAME: gloo's ranks talk over the link between the hosts.
        env = cli_env(GLOO_SOCKET_IFNAME=HOST_LINK)
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
