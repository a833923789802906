"""Peak memory of a process and everything it started, sampled in a background thread.

A process's own high-water mark (VmHWM) misses the workers it spawns. This sums the
PSS (proportional set size) of the process and its descendants, so pages that forked or spawned
workers share are counted once, and keeps the highest sum seen: what a node must hold for a
job such as tokenizing with N processes.
"""

from __future__ import annotations

import os
import threading

import psutil

GIB = 2**30


class TreeMemory:
    def __init__(self, pid: int | None = None, every_s: float = 0.2):
        self.root = psutil.Process(pid or os.getpid())
        self.every_s, self.peak_bytes = every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)
        self._thread.start()

    def _sample(self) -> int:
        total = 0
        for p in [self.root, *self.root.children(recursive=True)]:
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass  # a worker that ended between the listing and the read
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak_bytes = max(self.peak_bytes, self._sample())
            except psutil.NoSuchProcess:
                return
            self._stop.wait(self.every_s)

    def stop(self) -> float:
        """Stop sampling; the peak in GiB."""
        self._stop.set()
        self._thread.join()
        return self.peak_bytes / GIB
