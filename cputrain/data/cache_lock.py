"""One writer per cache entry, across ranks, runs, nodes and pods that share data.cache_dir.

Whoever creates `<entry>.lock` (the heartbeat lock of cputrain.locks.heartbeat_lock: an atomic
exclusive create, atomic on local disks, NFSv3+ and Lustre) builds the entry; everyone else polls
for the entry's completion marker. Nobody waits in a collective, so a preparation of hours cannot
trip the process group's timeout, and a node whose disk is not shared simply gets its own writer.

A lock is taken over when its heartbeat is older than data.lock_stale_s, or when its holder ran on
this very machine (host name, boot and pid namespace) and that process is gone: a rank restarted
by the agent retakes at once instead of waiting out the timeout. Two pods with one host name are
two machines: neither takes the other's live lock.

A process that finds an entry missing may hand its build to a child (cputrain.data.prepare's
spawned builder): its build() raises HandOver, and the lock stays taken, held for the child, so
the other ranks of the node wait in their own process instead of each starting a builder of its
own that would only wait too. The child builds that entry without taking the lock again
(`built_for_parent`), then the entries that follow from it; the parent releases it when the child
has ended, and the others wait for that release, not only for the entry.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from cputrain.locks.heartbeat_lock import HeartbeatLock, LockContended
from cputrain.locks.lock_file import LocalLockFile

log = logging.getLogger("cputrain")

POLL_S = 1.0
# A complete entry waits only for its lock's release, which the ranks of a node then pass together
# into their first collective: look often, so none arrives a poll behind the rest.
RELEASE_POLL_S = 0.1
WAIT_LOG_EVERY_S = 30.0

# The entries whose lock the process that started this one holds for it (see built_for_parent).
_HELD_BY_PARENT: set[Path] = set()


class HandOver(Exception):
    """Raised by a build() that another process will run. build_once keeps the entry's lock taken and
    hands it over in `.lock`: the raiser releases it once that process has ended."""

    lock: WriterLock | None = None


@contextlib.contextmanager
def built_for_parent(lock_path: Path) -> Iterator[None]:
    """In a builder process: the entry of `lock_path` is built here without taking its lock, which the
    process that started this one took and holds (and beats) until this one ends."""
    _HELD_BY_PARENT.add(Path(lock_path))
    try:
        yield
    finally:
        _HELD_BY_PARENT.discard(Path(lock_path))


class WriterLock:
    """The lock of one cache entry: the heartbeat lock on a local (or shared) file."""

    def __init__(self, path: Path, stale_after_s: float):
        self.path = Path(path)
        # a beat every quarter of the stale time (at most 10 s): three may be missed
        self.lock = HeartbeatLock(LocalLockFile(str(self.path)), min(10.0, stale_after_s / 4), stale_after_s)

    def holder(self) -> dict | None:
        return self.lock.holder()

    def held(self) -> bool:
        """Whether someone who still counts holds the lock (not a stale or ended holder)."""
        holder = self.lock.holder()
        return holder is not None and self.lock.free_because(holder) is None

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
    if Path(lock_path) in _HELD_BY_PARENT:
        if is_complete():
            return False
        build()
        return True
    lock = WriterLock(lock_path, stale_after_s)
    waited_since, last_log = time.monotonic(), 0.0
    # A complete entry whose lock is still held is one handed over (HandOver): its holder's builder
    # goes on to the entries that follow from it (the token cache after the tokenizer). Waiting for
    # the release, not the entry, keeps this process from starting a builder of its own for those.
    while True:
        complete = is_complete()
        if complete and not lock.held():
            return False
        if lock.try_acquire():
            handed_over = False
            try:
                if is_complete():  # finished by the previous holder between our check and the lock
                    return False
                build()
                return True
            except HandOver as hand_over:
                hand_over.lock, handed_over = lock, True
                raise
            finally:
                if not handed_over:
                    lock.release()
        now = time.monotonic()
        if now - last_log >= WAIT_LOG_EVERY_S:
            info = lock.holder() or {}
            doing = f"the preparation that followed {what}" if complete else f"{what}{progress()}"
            log.info("data: waiting %.0f s for %s (pid %s) to finish %s", now - waited_since, info.get("host", "?"),
                     info.get("pid", "?"), doing)
            last_log = now
        time.sleep(RELEASE_POLL_S if complete else POLL_S)
