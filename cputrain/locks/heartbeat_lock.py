"""One heartbeat lock: a file whose creation is the lock, a JSON record naming its holder, and a
thread that rewrites the record every `heartbeat_s` seconds. Used by run.lock (one writer per run
folder) and by each token-cache entry (one writer per entry, among every rank, run, node and pod
that shares data.cache_dir).

    {"token": "…", "host": "node-a", "boot_id": "…", "pid_namespace": "pid:[4026531836]",
     "pid": 4242, "pid_start": "8812", "user": "ana", "job": …, "restart": …,
     "since": "2026-05-04T10:00:00Z", "heartbeat": "2026-05-04T10:41:20Z", "heartbeat_s": 1777891280.1,
     "stale_after_s": 120}

A holder no longer counts, and its lock is taken over, when
  - it is provably on this same machine (the same host name AND boot AND pid namespace, the last
    two known) and its process is gone, or its pid now belongs to another process (another start
    time);
  - its heartbeat is older than `stale_after_s` (a record without one is judged by the file's
    modification time); the hosts' clocks must agree to well within that;
  - the taker was told to (`take_over`).
A host name alone says nothing: a pod rescheduled under its name, or Indexed Job pods on several
nodes, share a host name but not a boot or a pid namespace, so a pid of theirs cannot be looked up
here. Such a holder counts for as long as it beats. So does one whose boot or pid namespace is
unknown (no /proc): two such pods would otherwise be one machine by their host name alone.

The holder learns at each heartbeat whether the file still holds its token; `assert_held` raises
once it does not (cheap: it reads no file, so it may run before every write).
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone

from cputrain.errors import one_line
from cputrain.hardware import read_system_file

log = logging.getLogger("cputrain")

TAKE_TRIES = 20  # rounds of create / judge / take over before giving up on a lock others keep taking


class LockContended(Exception):
    """Other processes kept taking the lock in every round."""


class LockLost(Exception):
    """Another process took the lock over; `holder` is its record ({} when the file was removed)."""

    def __init__(self, holder: dict):
        super().__init__("the lock was taken over" if holder else "the lock file was removed")
        self.holder = holder


def utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): a pid that
    was reused by another process has another start time. None where there is no such process."""
    stat = read_system_file(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if fields[0] in ("Z", "X"):  # a zombie has ended; only its exit status is left
        return None
    return fields[19]


def machine() -> dict:
    """What makes a pid meaningful: the same host name, boot and pid namespace (containers that
    share a host name, or a rebooted host, number their processes afresh)."""
    ns = None
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return {"host": socket.gethostname(), "boot_id": read_system_file("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": ns}


def user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no name for this uid (some containers)
        return str(os.getuid())


class HeartbeatLock:
    def __init__(self, file, heartbeat_s: float, stale_after_s: float, take_over: bool = False):
        """`file`: a cputrain.locks.lock_file object (a local path or an fsspec URL)."""
        self.file, self.heartbeat_s, self.stale_after_s, self.take_over = file, heartbeat_s, stale_after_s, take_over
        self.token = uuid.uuid4().hex
        self.lost: dict | None = None  # set by the heartbeat when another holder took the lock
        self.on_lost: Callable[[dict], None] = lambda holder: None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        now = time.time()
        self.record = {
            "token": self.token, **machine(), "pid": os.getpid(), "pid_start": process_start(os.getpid()),
            "user": user(), "job": os.environ.get("TORCHELASTIC_RUN_ID"),
            "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
            "since": utc(now), "heartbeat": utc(now), "heartbeat_s": now, "stale_after_s": stale_after_s,
        }

    # --------------------------------------------------------------------------------------
    def try_acquire(self, on_take_over: Callable[[dict, str], None] = lambda holder, why: None) -> dict | None:
        """Take the lock: None once it is this process's (and beating), else the live holder's
        record. A holder that no longer counts is removed, `on_take_over(holder, why)` said first."""
        for _ in range(TAKE_TRIES):
            if self.file.create(self._encode()):
                mine = self.holder()
                if mine and mine.get("token") == self.token:
                    self._thread = threading.Thread(target=self._beat, name="cputrain-lock-heartbeat", daemon=True)
                    self._thread.start()
                    return None
                continue  # an emulated exclusive create lost a race: look again
            holder = self.holder(wait_s=2.0)
            if holder is None:
                continue  # released while we looked
            why = self.free_because(holder)
            if why is None:
                return holder
            # Remove only the very lock judged free: another process may have taken it over meanwhile.
            if self.file.remove_if(holder["_raw"]):
                on_take_over(holder, why)
        raise LockContended()

    def holder(self, wait_s: float = 0.0) -> dict | None:
        """The holder's record, with its heartbeat's age (`heartbeat_age_s`). A file just created
        but not yet written is read again for `wait_s`, then judged by its modification time."""
        deadline = time.monotonic() + wait_s
        while True:
            data = self.file.read()
            if data is None:
                return None
            try:
                holder = json.loads(data)
            except ValueError:
                holder = None
            if isinstance(holder, dict) or time.monotonic() >= deadline:
                holder = holder if isinstance(holder, dict) else {"host": "?", "pid": "?", "unreadable": True}
                beat = holder.get("heartbeat_s")
                if not isinstance(beat, (int, float)):
                    beat = self.file.modified_s() or time.time()
                return {**holder, "heartbeat_age_s": max(0.0, time.time() - beat), "_raw": data}
            time.sleep(0.1)

    def free_because(self, holder: dict) -> str | None:
        """Why the holder no longer counts, or None while it does."""
        if self.take_over:
            return "told to take it over"
        pid = holder.get("pid")
        if self.same_machine(holder) and isinstance(pid, int):
            started, recorded = process_start(pid), holder.get("pid_start")
            # A pid alive here with no start time on record may be the holder: only the heartbeat tells.
            if started is None or (recorded is not None and started != recorded):
                return f"its process {pid} on this host has ended"
        age_s = holder["heartbeat_age_s"]
        if age_s > self.stale_after_s:
            return f"its last heartbeat is {age_s:.0f}s old (over {self.stale_after_s:.0f}s)"
        return None

    @staticmethod
    def same_machine(holder: dict) -> bool:
        """Whether the holder's pid means a process here: same host name, boot and pid namespace."""
        here = machine()
        known = here["boot_id"] is not None and here["pid_namespace"] is not None
        return known and all(holder.get(k) == v for k, v in here.items())

    def _encode(self) -> bytes:
        return (json.dumps(self.record, indent=1) + "\n").encode()

    # --------------------------------------------------------------------------------------
    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                holder = self.holder()
                if holder is None or holder.get("token") != self.token:
                    self.lost = holder or {}
                    self.on_lost(self.lost)
                    return
                now = time.time()
                self.record.update(heartbeat=utc(now), heartbeat_s=now)
                self.file.replace(self._encode(), self.token)
            except Exception as exc:  # a file system hiccup: the next beat tries again
                log.warning("%s: heartbeat failed (%s)", self.file.path, one_line(exc))

    def assert_held(self) -> None:
        """Raise LockLost if the last heartbeat found the lock taken over or removed."""
        if self.lost is not None:
            raise LockLost(self.lost)

    def release(self) -> None:
        """Stop beating and remove the file if it is still this process's (else leave it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + 5)
            self._thread = None
        holder = self.holder()
        if holder is not None and holder.get("token") == self.token:
            # Only these very bytes: a process that judged us stale meanwhile keeps its new lock.
            self.file.remove_if(holder["_raw"])
