"""The cache writer lock: one holder, a heartbeat, and take-over of a dead or silent holder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from cputrain.data.cache_lock import WriterLock, build_once
from cputrain.locks import heartbeat_lock
from cputrain.locks.heartbeat_lock import machine


def test_one_holder_at_a_time_and_release(tmp_path):
    a, b = WriterLock(tmp_path / "x.lock", 60), WriterLock(tmp_path / "x.lock", 60)
    assert a.try_acquire()
    assert not b.try_acquire()
    holder = b.holder()
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    a.release()
    assert not (tmp_path / "x.lock").exists()
    assert b.try_acquire()
    b.release()


def test_silent_holder_is_taken_over_after_the_stale_time(tmp_path):
    path = tmp_path / "x.lock"
    # A holder on another host (its pid means nothing here) whose heartbeat stopped 100 s ago.
    path.write_text(json.dumps({"host": "node-7", "pid": 1, "since": "earlier"}))
    old = time.time() - 100
    os.utime(path, (old, old))
    assert not WriterLock(path, stale_after_s=300).try_acquire()  # still within its time
    taker = WriterLock(path, stale_after_s=60)
    assert taker.try_acquire()
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == ["x.lock"]  # the stale file is cleared away
    taker.release()


def test_dead_holder_on_this_machine_is_taken_over_at_once(tmp_path):
    path = tmp_path / "x.lock"
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path.write_text(json.dumps({**machine(), "pid": int(child.stdout), "pid_start": "1", "heartbeat_s": time.time()}))
    lock = WriterLock(path, stale_after_s=3600)  # its heartbeat is fresh, but its process is gone
    assert lock.try_acquire()
    lock.release()


def test_two_holders_with_one_host_name_are_two_machines(tmp_path):
    """A pod rescheduled under its name, or Indexed Job pods on several nodes, share a host name and
    a cache on a shared volume. The other pod's pid cannot be looked up here: its live lock holds
    for as long as it beats, and is taken over only once its heartbeat is older than the limit."""
    path = tmp_path / "x.lock"
    gone_here = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here = machine()
    other_node = {"host": here["host"], "boot_id": "another-boot", "pid_namespace": here["pid_namespace"]}
    container_here = {"host": here["host"], "boot_id": here["boot_id"], "pid_namespace": "pid:[1]"}
    for other_pod in (other_node, container_here):
        record = {**other_pod, "pid": int(gone_here.stdout), "pid_start": "1", "token": "other"}
        path.write_text(json.dumps({**record, "heartbeat_s": time.time() - 5}))
        assert not WriterLock(path, stale_after_s=60).try_acquire(), other_pod  # alive elsewhere: not ours
        assert json.loads(path.read_text())["token"] == "other"
        path.write_text(json.dumps({**record, "heartbeat_s": time.time() - 61}))  # it stopped beating
        taker = WriterLock(path, stale_after_s=60)
        assert taker.try_acquire(), other_pod
        assert json.loads(path.read_text())["pid"] == os.getpid()
        taker.release()


def test_without_boot_id_and_pid_namespace_a_host_name_is_not_a_machine(tmp_path, monkeypatch):
    """Where /proc tells neither (two such pods would look alike), a pid is never judged: only the heartbeat."""
    monkeypatch.setattr(heartbeat_lock, "machine", lambda: {"host": socket.gethostname(), "boot_id": None,
                                                            "pid_namespace": None})
    path = tmp_path / "x.lock"
    gone_here = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {**heartbeat_lock.machine(), "pid": int(gone_here.stdout), "pid_start": "1", "token": "other"}
    path.write_text(json.dumps({**record, "heartbeat_s": time.time()}))
    assert not WriterLock(path, stale_after_s=60).try_acquire()
    path.write_text(json.dumps({**record, "heartbeat_s": time.time() - 61}))
    taker = WriterLock(path, stale_after_s=60)
    assert taker.try_acquire()
    taker.release()


def test_heartbeat_keeps_a_live_holder(tmp_path):
    path = tmp_path / "x.lock"
    # Beats every 0.25 s, stale after 1 s: past that age a holder without beats would be judged
    # dead; a beat's thread woken up to 0.75 s late (a machine shared with other tests) still passes.
    holder = WriterLock(path, stale_after_s=1.0)
    assert holder.try_acquire()
    time.sleep(1.5)
    info = WriterLock(path, 1.0).holder()
    assert info["heartbeat_age_s"] < 1.0
    assert not WriterLock(path, 1.0).try_acquire()
    holder.release()


def test_build_once_builds_once(tmp_path):
    built = []
    marker = tmp_path / "done"

    def build():
        built.append(1)
        marker.write_text("x")

    assert build_once(tmp_path / "e.lock", marker.exists, build, "test", 60)
    assert not build_once(tmp_path / "e.lock", marker.exists, build, "test", 60)
    assert built == [1] and not (tmp_path / "e.lock").exists()


def test_a_handed_over_entry_is_waited_for_until_its_lock_is_released(tmp_path):
    """A build() that raises HandOver leaves the lock taken for another process; that process builds
    the entry without the lock (built_for_parent). Others wait for the release, not only for the
    entry: the builder goes on to what follows from it, which they must not start building too."""
    import threading

    from cputrain.data import cache_lock

    lock_path, marker = tmp_path / "e.lock", tmp_path / "done"

    def hand_over():
        raise cache_lock.HandOver

    with pytest.raises(cache_lock.HandOver) as raised:
        build_once(lock_path, marker.exists, hand_over, "test", 60)
    held = raised.value.lock
    assert held.path == lock_path and not WriterLock(lock_path, 60).try_acquire()
    with cache_lock.built_for_parent(lock_path):  # the child: builds without taking the lock
        assert build_once(lock_path, marker.exists, lambda: marker.write_text("x"), "test", 60)
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (build_once(lock_path, marker.exists, hand_over, "test", 60),
                                              returned.set()))
    waiter.start()
    time.sleep(0.5)
    assert not returned.is_set(), "a waiter went on while the entry's lock was still held"
    held.release()
    waiter.join(10)
    assert returned.is_set() and not lock_path.exists()
