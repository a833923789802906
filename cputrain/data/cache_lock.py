"""One writer per cache entry, across ranks, runs, nodes and pods that share data.cache_dir.

Whoever creates `<entry>.lock` (the heartbeat lock of cputrain.locks.heartbeat_lock: an atomic
exclusive create, atomic on local disks, NFSv3+ and Lustre) builds the entry; everyone else polls
for the entry's completion marker. Nobody waits in a collective, so a preparation of hours cannot
trip the process group's timeout, and a node whose disk is not shared simply gets its own writer.

A lock is taken over when its heartbeat is older than data.lock_stale_s, or when its holder ran on
this very machine (host name, boot and pid namespace) and that process is gone: a rank restarted
by the agent retakes at once instead of waiting out the timeout. Two pods with one host name are
two machines: neither takes the other's live lock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from cputrain.locks.heartbeat_lock import HeartbeatLock, LockContended
from cputrain.locks.lock_file import LocalLockFile

log = logging.getLogger("cputrain")

POLL_S = 1.0
WAIT_LOG_EVERY_S = 30.0


class WriterLock:
    """The lock of one cache entry: the heartbeat lock on a local (or shared) file."""

    def __init__(self, path: Path, stale_after_s: float):
        self.path = Path(path)
        # a beat every quarter of the stale time (at most 10 s): three may be missed
        self.lock = HeartbeatLock(LocalLockFile(str(self.path)), min(10.0, stale_after_s / 4), stale_after_s)

    def holder(self) -> dict | None:
        return self.lock.holder()

    def try_acquire(self) -> bool:
        def taking_over(holder: dict, why: str) -> None:
            log.warning("data: taking over %s from %s (pid %s): %s", self.path.name, holder.get("host"),
                        holder.get("pid"), why)

        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self.lock.try_acquire(taking_over) is None
        except LockContended:
            return False  # others keep taking it: wait for the entry like any other waiter

    def release(self) -> None:
        self.lock.release()


def build_once(lock_path: Path, is_complete: Callable[[], bool], build: Callable[[], None], what: str,
               stale_after_s: float, progress: Callable[[], str] = lambda: "") -> bool:
    """Build an entry exactly once among everyone sharing the folder. True if this process built it."""
    lock = WriterLock(lock_path, stale_after_s)
    waited_since, last_log = time.monotonic(), 0.0
    while not is_complete():
        if lock.try_acquire():
            try:
                if is_complete():  # finished by the previous holder between our check and the lock
                    return False
                build()
                return True
            finally:
                lock.release()
        now = time.monotonic()
        if now - last_log >= WAIT_LOG_EVERY_S:
            info = lock.holder() or {}
            log.info("data: waiting %.0f s for %s (pid %s) to finish %s%s", now - waited_since, info.get("host", "?"),
                     info.get("pid", "?"), what, progress())
            last_log = now
        time.sleep(POLL_S)
    return False
