"""A node left waiting for a rendezvous host that is gone.

The c10d rendezvous lives in node 0's agent. When node 0 vanishes without closing its
connections (powered off, its network gone), the other nodes' ranks end within
parallel.timeout_s (distributed.lost_peer), but torch's agent then waits in a call to node 0's
store that does not end: measured here, still waiting a minute after every timeout had passed,
so the node would hang until someone kills it. In the agent of every node but node 0, this watch
ends the agent once no rank runs on the node and the rendezvous endpoint has not accepted a
connection for launch.rdzv_timeout_s: one line, exit code 2. It stays unarmed until a rank has
run, so the first rendezvous keeps torch's own timeout and message.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import psutil

from cputrain.errors import UserError

EXIT_CODE = 2  # as every rendezvous failure: something to bring back, then re-run


def endpoint_answers(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at host:port (then closed at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def ranks_running() -> bool:
    """Whether a child of this process (the agent's ranks) is alive."""
    return any(child.status() != psutil.STATUS_ZOMBIE for child in _children())


def _children() -> list[psutil.Process]:
    try:
        return psutil.Process().children()
    except psutil.Error:
        return []


class HostWatch:
    def __init__(self, host: str, port: int, patience_s: float,
                 answers: Callable[[], bool] | None = None, running: Callable[[], bool] = ranks_running,
                 clock: Callable[[], float] = time.monotonic):
        self.host, self.port, self.patience_s = host, port, patience_s
        self.answers = answers or (lambda: endpoint_answers(host, port))
        self.running, self.clock = running, clock
        self.armed = False  # a rank has run: the first rendezvous is over
        self.silent_since: float | None = None

    def lost(self) -> bool:
        """One look: True once no rank has run here and the host has not answered for patience_s."""
        if self.running():
            self.armed, self.silent_since = True, None
            return False
        if not self.armed:
            return False
        if self.answers():
            self.silent_since = None
            return False
        now = self.clock()
        if self.silent_since is None:
            self.silent_since = now
        return now - self.silent_since >= self.patience_s

    def message(self) -> str:
        return (f"the rendezvous host {self.host}:{self.port} (node 0) has not answered for {self.patience_s:g} s "
                "(launch.rdzv_timeout_s) and no rank runs on this node: node 0 is lost or this node's network is "
                "down; run the same command on every node, node 0 first, to resume from the newest checkpoint")

    def start(self, every_s: float = 1.0) -> threading.Thread:
        """Look every `every_s` in a daemon thread; once lost, say so and end this process."""
        def watch():
            while not self.lost():
                time.sleep(every_s)
            print(f"{UserError.label}{self.message()}", file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)  # the agent's main thread is stuck in torch's store call

        thread = threading.Thread(target=watch, name="cputrain-host-watch", daemon=True)
        thread.start()
        return thread
