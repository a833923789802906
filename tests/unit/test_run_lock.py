"""run.lock: one writer per run folder, a holder named when refused, stale and dead holders taken over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import fsspec
import pytest

from cputrain.run_folder.layout import RunFolder
from cputrain.locks.heartbeat_lock import machine as _machine, process_start as _process_start
from cputrain.run_folder.run_lock import LOCK_NAME, RunLock
from cputrain.errors import RunFolderError


def _lock(folder, **kw) -> RunLock:
    return RunLock(RunFolder(str(folder)), **kw)


def _fake_holder(folder, **fields) -> dict:
    """A lock file as another run would have left it."""
    now = time.time()
    holder = {"token": "other", "host": "node-b", "pid": 4242, "user": "ana", "since": "2026-01-01T00:00:00Z",
              "heartbeat": "2026-01-01T00:00:00Z", "heartbeat_s": now, "job": None, **fields}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps(holder))
    return holder


def test_second_run_is_refused_naming_the_holder(tmp_path):
    first = _lock(tmp_path / "run")
    first.acquire()
    try:
        lock = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert {"token", "host", "pid", "user", "since", "heartbeat", "heartbeat_s"} <= set(lock)
        with pytest.raises(RunFolderError) as err:
            _lock(tmp_path / "run").acquire()
        text = str(err.value)
        assert "is in use by another run" in text and "\n" not in text
        for part in (f"host {lock['host']}", f"pid {lock['pid']}", f"since {lock['since']}", "last heartbeat 0s ago",
                     "--take-over-lock"):
            assert part in text, text
    finally:
        first.release()
    assert not (tmp_path / "run" / LOCK_NAME).exists()
    again = _lock(tmp_path / "run")
    again.acquire()  # released: free again
    again.release()


def test_only_one_of_many_simultaneous_runs_gets_it(tmp_path):
    locks = [_lock(tmp_path / "run") for _ in range(8)]
    results = []

    def take(lock):
        try:
            lock.acquire()
            results.append(lock)
        except RunFolderError:
            pass

    threads = [threading.Thread(target=take, args=(lock,)) for lock in locks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 1
    results[0].release()


def test_a_live_holder_on_another_host_is_refused_a_stale_one_taken_over(tmp_path, caplog):
    run = tmp_path / "run"
    _fake_holder(run, heartbeat_s=time.time() - 30)
    with pytest.raises(RunFolderError, match="host node-b, pid 4242, user ana, since 2026-01-01T00:00:00Z, "
                                             "last heartbeat 30s ago"):
        _lock(run).acquire()
    _fake_holder(run, heartbeat_s=time.time() - 121)  # over STALE_AFTER_S (120 s)
    lock = _lock(run)
    lock.acquire()
    assert json.loads((run / LOCK_NAME).read_text())["token"] == lock.token
    assert "its last heartbeat is 121s old (over 120s)" in caplog.text
    lock.release()


def test_take_over_flag_takes_a_live_lock(tmp_path):
    run = tmp_path / "run"
    _fake_holder(run)
    lock = _lock(run, take_over=True)
    lock.acquire()
    assert json.loads((run / LOCK_NAME).read_text())["token"] == lock.token
    lock.release()


def test_a_dead_process_on_this_machine_is_taken_over_at_once(tmp_path, caplog):
    """A rank 0 killed with SIGKILL (or the previous round of a torchrun job) left its lock behind."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    _fake_holder(run, **_machine(), pid=dead.pid, pid_start="1")
    lock = _lock(run)
    lock.acquire()
    assert f"its process {dead.pid} on this host has ended" in caplog.text
    lock.release()
    # a live process of this machine with a fresh heartbeat still counts
    _fake_holder(run, **_machine(), pid=dead.pid, pid_start="1")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _fake_holder(run, **_machine(), pid=live.pid, pid_start=_process_start(live.pid))
        with pytest.raises(RunFolderError, match=f"pid {live.pid}"):
            _lock(run).acquire()
        # the same pid reused by another process (another start time) does not
        _fake_holder(run, **_machine(), pid=live.pid, pid_start="12345")
        lock = _lock(run)
        lock.acquire()
        lock.release()
    finally:
        live.kill()
        live.wait()


def test_a_live_pid_with_no_start_time_on_record_counts_while_it_beats(tmp_path):
    """Without the holder's start time a live pid here may well be the holder: it is not judged dead."""
    run = tmp_path / "run"
    _fake_holder(run, **_machine(), pid=os.getpid(), pid_start=None)
    with pytest.raises(RunFolderError, match="in use by another run"):
        _lock(run).acquire()


def _within(seconds: float, condition) -> bool:
    """Poll `condition` until it holds or `seconds` pass: a beat's thread may wake late on a
    machine shared with other tests, so the test waits for the beat instead of a fixed sleep."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _taken_over(lock) -> bool:
    try:
        lock.assert_held()
    except RunFolderError as err:
        assert "was taken over by another run" in str(err)
        return True
    return False


def test_heartbeat_refreshes_and_a_taken_over_run_stops(tmp_path):
    run = tmp_path / "run"
    lock = _lock(run, heartbeat_s=0.05)
    lock.acquire()
    first = json.loads((run / LOCK_NAME).read_text())["heartbeat_s"]
    assert _within(5, lambda: json.loads((run / LOCK_NAME).read_text())["heartbeat_s"] > first)
    lock.assert_held()
    taker = _lock(run, take_over=True)
    taker.acquire()
    assert _within(5, lambda: _taken_over(lock))  # its next beat finds another run's token
    lock.release()  # not its lock any more: left in place
    assert json.loads((run / LOCK_NAME).read_text())["token"] == taker.token
    taker.release()


def test_a_lock_file_being_written_is_read_again_before_judging(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text("")  # created, content not written yet
    with pytest.raises(RunFolderError, match="in use by another run"):
        _lock(run).acquire()


def test_fsspec_run_folder(tmp_path):
    """A run folder given as a URL takes the lock through fsspec's exclusive create."""
    fs = fsspec.filesystem("memory")
    url = "memory://locks/run"
    first = RunLock(RunFolder(url))
    first.acquire()
    assert fs.exists("/locks/run/run.lock")
    with pytest.raises(RunFolderError, match="in use by another run"):
        RunLock(RunFolder(url)).acquire()
    first.release()
    assert not fs.exists("/locks/run/run.lock")
