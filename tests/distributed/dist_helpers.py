"""What the distributed tests share: free ports, run figures, and a check that no rank outlives its test."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from harness.warm_client import with_forked_ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains `text` (a test's unique output folder), and the
    ranks forked for them by the warm rank server (harness.warm_client.with_forked_ranks), ranks first."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(text in part for part in p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return with_forked_ranks(found)


def assert_no_survivors(text: str, grace_s: float = 10.0) -> None:
    deadline = time.time() + grace_s
    while time.time() < deadline:
        if not processes_mentioning(str(text)):
            return
        time.sleep(0.2)
    left = processes_mentioning(str(text))
    for p in left:
        p.kill()
    raise AssertionError(f"{len(left)} process(es) outlived the run: {[p.pid for p in left]}")


HOST_ADDRS = ("10.77.0.1", "10.77.0.2")  # exist only inside the namespaces two_hosts makes
HOST_LINK = "ctlink"  # the link's name on both hosts: one GLOO_SOCKET_IFNAME for every rank


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def two_hosts():
    """Two network namespaces joined by a veth pair (HOST_LINK on both ends), as two hosts on one
    machine: yields [(namespace, address)] for each. Skips where this is not root or has no `ip`."""
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("`ip` (iproute2) is not installed")
    tag = uuid.uuid4().hex[:6]
    names = [f"ct{tag}a", f"ct{tag}b"]
    try:
        for ns in names:
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", f"vc{tag}a", "netns", names[0], "type", "veth", "peer", "name", f"vc{tag}b", "netns", names[1])
        for ns, end, addr in zip(names, (f"vc{tag}a", f"vc{tag}b"), HOST_ADDRS):
            _ip("-n", ns, "link", "set", end, "name", HOST_LINK)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", HOST_LINK)
            _ip("-n", ns, "link", "set", HOST_LINK, "up")
        yield list(zip(names, HOST_ADDRS))
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
