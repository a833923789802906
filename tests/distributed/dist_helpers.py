"""What the distributed tests share: free ports, run figures, a check that no rank outlives its test,
and two hosts on this machine (network namespaces) with a node of a run on each."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest

from harness.cli_env import cli_env
from harness.repo import REPO
from harness.run_metrics import losses_by_step as losses  # noqa: F401  the name the tests here import
from harness.warm_client import with_forked_ranks


def _port_band() -> range:
    """This worker's slice of the ports below the kernel's ephemeral range. A port from bind(0) is
    an ephemeral one: until the process it is handed to binds it (seconds later, after a rank's
    imports), any outgoing connection on the machine can be given it (EADDRINUSE at random). Below
    the range only an explicit bind takes a port, and each pytest-xdist worker has its own slice."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    width = (ephemeral_low - 20000) // workers
    return range(20000 + worker * width, 20000 + (worker + 1) * width)


_next_port = itertools.count()


def free_port() -> int:
    """A port of this worker's band that binds now; the next call starts after it."""
    band = _port_band()
    for _ in range(len(band)):
        port = band[next(_next_port) % len(band)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # held, or in TIME_WAIT after an earlier test
            return port
    raise RuntimeError(f"no free port in {band}")


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


def netns_pids(ns: str) -> list[int]:
    """Every process inside network namespace `ns`: a node's agent and its ranks."""
    listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in listed]


def kill_netns(ns: str) -> list[int]:
    """SIGKILL every process of the node in `ns` at once, as when its machine is lost."""
    pids = netns_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def set_link(ns: str, up: bool) -> None:
    """The node's end of the link between the hosts, up or down (its cable pulled or put back)."""
    _ip("-n", ns, "link", "set", HOST_LINK, "up" if up else "down")


class Node:
    """One node's `cputrain train --nnodes N --node-rank I` in its namespace (a fresh interpreter,
    as on a host of its own); its output (stdout and stderr together) read as it comes, each line
    with the time it arrived."""

    def __init__(self, ns: str, node_rank: int, nnodes: int, endpoint: str, overrides: list[str]):
        # GLOO_SOCKET_IFNAME: gloo's ranks talk over the link between the hosts.
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "cputrain", "train", *overrides,
               "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node", "1",
               "--rdzv-endpoint", endpoint]
        self.ns, self.node_rank = ns, node_rank
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(GLOO_SOCKET_IFNAME=HOST_LINK), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self.ended_at: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
        self.proc.wait()
        self.ended_at = time.monotonic()

    def line(self, text: str, since: float = 0.0) -> tuple[float, str] | None:
        """The first line containing `text` that arrived at or after `since`, with its time."""
        return next(((t, line) for t, line in list(self.lines) if t >= since and text in line), None)

    def wait_for_line(self, text: str, timeout_s: float, since: float = 0.0) -> tuple[float, str] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.line(text, since)
            if found or self.ended_at is not None:
                return found or self.line(text, since)
            time.sleep(0.02)
        return None

    def wait(self, timeout_s: float) -> int | None:
        """The exit code, or None if the node still runs after `timeout_s`."""
        self._reader.join(timeout_s)
        return self.proc.returncode if self.ended_at is not None else None

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def last_line(self) -> str:
        """The last line cputrain itself printed (torch's own log lines start otherwise)."""
        return next((line for _, line in reversed(self.lines) if line.startswith("cputrain:")), "")
