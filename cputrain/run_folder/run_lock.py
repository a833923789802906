"""One writer per run folder: `run.lock` in it names the run that writes there.

    {"token": "…", "host": "node-a", "pid": 4242, "user": "ana", "since": "2026-05-04T10:00:00Z",
     "heartbeat": "2026-05-04T10:41:20Z", "heartbeat_s": 1777891280.1, "stale_after_s": 120,
     "job": "cputrain-…" (TORCHELASTIC_RUN_ID), "restart": 0, "pid_start": …, "boot_id": …, "pid_namespace": …}

Rank 0 takes it before anything is written into the folder: the heartbeat lock of
cputrain.locks.heartbeat_lock (an atomic create; a thread rewrites the heartbeat every HEARTBEAT_S
seconds). A second run is refused with one line naming the holder. The lock is taken over,
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

import logging
import os
import time

from cputrain.errors import RunFolderError, one_line
from cputrain.locks.heartbeat_lock import HeartbeatLock, LockContended, LockLost
from cputrain.locks.lock_file import FsspecLockFile, LocalLockFile
from cputrain.run_folder.layout import RunFolder

log = logging.getLogger("cputrain")

LOCK_NAME = "run.lock"
HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0  # eight missed heartbeats: a slow shared file system does not lose the lock


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
        self.run, self.stale_after_s = run, stale_after_s
        local = run.local_path()
        file = LocalLockFile(os.path.join(local, LOCK_NAME)) if local is not None else \
            FsspecLockFile(run.fs, run.path(LOCK_NAME))
        self.lock = HeartbeatLock(file, heartbeat_s, stale_after_s, take_over)
        self.lock.on_lost = lambda holder: log.error("output_dir %s: %s is no longer this run's (%s)", run.url,
                                                     LOCK_NAME, holder_text(holder) if holder else "removed")
        self.token = self.lock.token

    def acquire(self) -> None:
        def taking_over(holder: dict, why: str) -> None:
            why = "--take-over-lock" if self.lock.take_over else why
            log.warning("output_dir %s: taking over %s of the run (%s): %s", self.run.url, LOCK_NAME,
                        holder_text(holder), why)

        try:
            holder = self.lock.try_acquire(taking_over)
        except LockContended:
            raise RunFolderError(f"could not take {LOCK_NAME} in output_dir '{self.run.url}': other runs keep taking "
                                 "it; make sure only one run uses this output_dir") from None
        except Exception as exc:  # the folder cannot hold a file: say so in one line
            raise RunFolderError(f"cannot create the lock {LOCK_NAME} in output_dir '{self.run.url}' "
                                 f"({one_line(exc)}); choose an output_dir on a writable file system") from None
        if holder is not None:
            raise RunFolderError(
                f"output_dir '{self.run.url}' is in use by another run ({holder_text(holder)}); wait for it "
                f"to end or choose another output_dir (a lock without a heartbeat for {self.stale_after_s:.0f}s "
                "is taken over; if that run is gone, --take-over-lock takes it now)")

    def assert_held(self) -> None:
        """Stop a run whose lock another run has taken over, before it writes beside it."""
        try:
            self.lock.assert_held()
        except LockLost as lost:
            who = holder_text(lost.holder) if lost.holder else "the lock file was removed"
            raise RunFolderError(f"{LOCK_NAME} in output_dir '{self.run.url}' was taken over by another run ({who}); "
                                 "this run stops so that only one run writes there") from None

    def release(self) -> None:
        try:
            self.lock.release()
        except Exception as exc:  # stale after STALE_AFTER_S anyway
            log.warning("output_dir %s: could not remove %s (%s)", self.run.url, LOCK_NAME, one_line(exc))


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
