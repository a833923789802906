"""One writer per run folder: `run.lock` in it names the run that writes there.

    {"token": "…", "host": "node-a", "pid": 4242, "user": "ana", "since": "2026-05-04T10:00:00Z",
     "heartbeat": "2026-05-04T10:41:20Z", "heartbeat_s": 1777891280.1, "stale_after_s": 120,
     "job": "cputrain-…" (TORCHELASTIC_RUN_ID), "restart": 0, "pid_start": …, "boot_id": …, "pid_namespace": …}

Rank 0 takes it before anything is written into the folder, with an atomic create
(checkpoint.lock_file), and a background thread rewrites the heartbeat every HEARTBEAT_S
seconds. A second run is refused with one line naming the holder. The lock is taken over,
with a warning, when
  - its holder ran on this machine (same host name, boot and pid namespace) and its process
    is gone: a run killed with SIGKILL, or rank 0 of an earlier round of the same torchrun
    job, which the agent restarts only after the old ranks ended;
  - its heartbeat is older than STALE_AFTER_S (a holder on another host that died, e.g. a
    preempted pod); the hosts' clocks must agree to well within that;
  - `cputrain train --take-over-lock` says so (the old run, if alive, sees at its next
    heartbeat that the lock is no longer its own and stops with an error).
It is released at the end of the run and on an error exit that Python unwinds.
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
from datetime import datetime, timezone

from cputrain.run_folder.layout import RunFolder
from cputrain.run_folder.lock_file import lock_file
from cputrain.errors import RunFolderError, one_line
from cputrain.hardware import read_system_file

log = logging.getLogger("cputrain")

LOCK_NAME = "run.lock"
HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0  # eight missed heartbeats: a slow shared file system does not lose the lock


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): a pid that
    was reused by another process has another start time. None where there is no such process."""
    stat = read_system_file(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    if fields[0] in ("Z", "X"):  # a zombie has ended; only its exit status is left
        return None
    return fields[19]


def _machine() -> dict:
    """What makes a pid meaningful: the same host name, boot and pid namespace (containers that
    share a host name, or a rebooted host, number their processes afresh)."""
    ns = None
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return {"host": socket.gethostname(), "boot_id": read_system_file("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": ns}


def holder_text(holder: dict, now_s: float | None = None) -> str:
    now_s = time.time() if now_s is None else now_s
    beat = holder.get("heartbeat_s")
    age = f"{max(0.0, now_s - beat):.0f}s ago" if isinstance(beat, (int, float)) else "unknown"
    job = f", job {holder['job']}" if holder.get("job") else ""
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{job}, user {holder.get('user', '?')}, "
            f"since {holder.get('since', '?')}, last heartbeat {age}")


class RunLock:
    def __init__(self, run: RunFolder, take_over: bool = False, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S):
        self.run, self.take_over = run, take_over
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.file = lock_file(run, LOCK_NAME)
        self.token = uuid.uuid4().hex
        self.lost: dict | None = None  # the holder that took the lock from this run
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        now = time.time()
        self.record = {
            "token": self.token, **_machine(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
            "user": _user(), "job": os.environ.get("TORCHELASTIC_RUN_ID"),
            "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT"),
            "since": _utc(now), "heartbeat": _utc(now), "heartbeat_s": now, "stale_after_s": stale_after_s,
        }

    # --------------------------------------------------------------------------------------
    def acquire(self) -> None:
        try:
            self._acquire()
        except RunFolderError:
            raise
        except Exception as exc:  # the folder cannot hold a file: say so in one line
            raise RunFolderError(f"cannot create the lock {LOCK_NAME} in output_dir '{self.run.url}' "
                                 f"({one_line(exc)}); choose an output_dir on a writable file system") from None
        self._thread = threading.Thread(target=self._beat, name="cputrain-run-lock", daemon=True)
        self._thread.start()

    def _acquire(self) -> None:
        for _ in range(20):
            if self.file.create(self._encode()):
                if self._holder() and self._holder().get("token") == self.token:
                    return
                continue  # an emulated exclusive create lost a race: look again
            holder = self._holder(wait_s=2.0)
            if holder is None:
                continue  # released while we looked
            why = self._free_because(holder)
            if why is None:
                raise RunFolderError(
                    f"output_dir '{self.run.url}' is in use by another run ({holder_text(holder)}); wait for it "
                    f"to end or choose another output_dir (a lock without a heartbeat for {self.stale_after_s:.0f}s "
                    "is taken over; if that run is gone, --take-over-lock takes it now)")
            # Remove only the very lock judged free: another run may have taken it over meanwhile.
            if self._holder() == holder:
                log.warning("output_dir %s: taking over %s of the run (%s): %s", self.run.url, LOCK_NAME,
                            holder_text(holder), why)
                self.file.remove()
        raise RunFolderError(f"could not take {LOCK_NAME} in output_dir '{self.run.url}': other runs keep taking "
                             "it; make sure only one run uses this output_dir")

    def _free_because(self, holder: dict) -> str | None:
        """Why the holder no longer counts, or None while it does."""
        if self.take_over:
            return "--take-over-lock"
        same_machine = all(holder.get(k) == v for k, v in _machine().items())
        pid = holder.get("pid")
        if same_machine and isinstance(pid, int) and _process_start(pid) != holder.get("pid_start"):
            return f"its process {pid} on this host has ended"
        beat = holder.get("heartbeat_s")
        if isinstance(beat, (int, float)) and time.time() - beat > self.stale_after_s:
            return f"its last heartbeat is {time.time() - beat:.0f}s old (over {self.stale_after_s:.0f}s)"
        return None

    def _holder(self, wait_s: float = 0.0) -> dict | None:
        """The lock's content; a file just created but not yet written is read again for `wait_s`,
        then judged by its modification time."""
        deadline = time.monotonic() + wait_s
        while True:
            data = self.file.read()
            if data is None:
                return None
            try:
                holder = json.loads(data)
                if isinstance(holder, dict):
                    return holder
            except ValueError:
                pass
            if time.monotonic() >= deadline:
                return {"host": "?", "pid": "?", "heartbeat_s": self.file.modified_s() or time.time(), "unreadable": True}
            time.sleep(0.1)

    def _encode(self) -> bytes:
        return (json.dumps(self.record, indent=1) + "\n").encode()

    # --------------------------------------------------------------------------------------
    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                holder = self._holder()
                if holder is None or holder.get("token") != self.token:
                    self.lost = holder or {}
                    log.error("output_dir %s: %s is no longer this run's (%s)", self.run.url, LOCK_NAME,
                              holder_text(self.lost) if holder else "removed")
                    return
                now = time.time()
                self.record.update(heartbeat=_utc(now), heartbeat_s=now)
                self.file.replace(self._encode(), self.token)
            except Exception as exc:  # a file system hiccup: the next beat tries again
                log.warning("output_dir %s: heartbeat of %s failed (%s)", self.run.url, LOCK_NAME, one_line(exc))

    def assert_held(self) -> None:
        """Stop a run whose lock another run has taken over, before it writes beside it."""
        if self.lost is not None:
            who = holder_text(self.lost) if self.lost else "the lock file was removed"
            raise RunFolderError(f"{LOCK_NAME} in output_dir '{self.run.url}' was taken over by another run ({who}); "
                                 "this run stops so that only one run writes there")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + 5)
            self._thread = None
        try:
            holder = self._holder()
            if holder is not None and holder.get("token") == self.token:
                self.file.remove()
        except Exception as exc:  # stale after STALE_AFTER_S anyway
            log.warning("output_dir %s: could not remove %s (%s)", self.run.url, LOCK_NAME, one_line(exc))


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no name for this uid (some containers)
        return str(os.getuid())


def take_run_lock(run: RunFolder, is_main: bool, take_over: bool = False) -> RunLock | None:
    """Rank 0 takes the lock; every rank learns whether it did, so a refused run ends on every
    rank at once (also under mpirun, where no agent stops the other ranks)."""
    from cputrain.distributed import process_group as pg

    lock, refused = None, None
    if is_main:
        lock = RunLock(run, take_over)
        try:
            lock.acquire()
        except RunFolderError as err:
            refused = str(err)
    refused = pg.broadcast_from_main(refused)
    if refused:
        raise RunFolderError(refused)
    return lock
