"""One writer per cache entry, across ranks, runs and nodes that share data.cache_dir.

Whoever creates `<entry>.lock` with an atomic exclusive create (O_CREAT|O_EXCL, atomic on local
disks, NFSv3+ and Lustre) builds the entry; everyone else polls for the entry's completion
marker. Nobody waits in a collective, so a preparation of hours cannot trip the process
group's timeout, and a node whose disk is not shared simply gets its own writer.

The holder refreshes the lock file's mtime every few seconds (a heartbeat thread). A lock is
stale, and is taken over, when its heartbeat is older than data.lock_stale_s, or when its
holder ran on this host and that process is gone (a rank restarted by the agent retakes at
once instead of waiting out the timeout).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

log = logging.getLogger("cputrain")

POLL_S = 1.0
WAIT_LOG_EVERY_S = 30.0


def _process_started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


class WriterLock:
    def __init__(self, path: Path, stale_after_s: float):
        self.path = Path(path)
        self.stale_after_s = stale_after_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --------------------------------------------------------------------------------------
    def holder(self) -> dict | None:
        try:
            info = json.loads(self.path.read_text() or "{}")
            info["heartbeat_age_s"] = time.time() - self.path.stat().st_mtime
            return info
        except (OSError, ValueError):
            return None

    def is_stale(self, info: dict) -> bool:
        if info.get("heartbeat_age_s", 0) > self.stale_after_s:
            return True
        if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
            started = _process_started(info["pid"])
            # Same pid but a later start time: the pid was reused, the holder is gone.
            return started is None or abs(started - info.get("pid_started", started)) > 1.0
        return False

    def try_acquire(self) -> bool:
        for _ in range(2):  # a second try after taking over a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                info = self.holder()
                if info is None or not self.is_stale(info):
                    return False
                # Renaming moves the stale file away atomically: of several waiters that all saw
                # it stale, exactly one rename succeeds, and the others go back to waiting.
                try:
                    os.rename(self.path, self.path.with_name(f"{self.path.name}.stale-{uuid.uuid4().hex[:8]}"))
                except FileNotFoundError:
                    return False
                log.warning("data: taking over %s from %s (pid %s), %.0f s since its last heartbeat",
                            self.path.name, info.get("host"), info.get("pid"), info.get("heartbeat_age_s", 0))
                for old in self.path.parent.glob(f"{self.path.name}.stale-*"):
                    old.unlink(missing_ok=True)
                continue
            me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": _process_started(os.getpid()),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(me))
            self._thread = threading.Thread(target=self._beat, name="cache-lock-heartbeat", daemon=True)
            self._thread.start()
            return True
        return False

    def _beat(self) -> None:
        every = min(10.0, self.stale_after_s / 4)
        while not self._stop.wait(every):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.path.unlink(missing_ok=True)


def build_once(lock_path: Path, is_complete: Callable[[], bool], build: Callable[[], None], what: str,
               stale_after_s: float, progress: Callable[[], str] = lambda: "") -> bool:
    """Build an entry exactly once among everyone sharing the folder. True if this process built it."""
    lock = WriterLock(lock_path, stale_after_s)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
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
