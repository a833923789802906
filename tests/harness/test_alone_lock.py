"""Under pytest-xdist a test marked `alone` runs with nothing beside it, and a waiting `alone` test
is not starved by the shared tests that come after it (the turnstile). Threads stand in for the
workers: a flock belongs to an open file, so two opens in one process contend as two workers do.
Who waits on which file is read from /proc/locks, not guessed from sleeps."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

from harness.alone_lock import alone_or_shared


def _waiting_on(path: Path) -> int:
    """How many flock requests wait on `path` (the lines of /proc/locks marked `->`)."""
    if not path.exists():
        return 0
    inode = f":{os.stat(path).st_ino}"
    return sum(1 for line in Path("/proc/locks").read_text().splitlines()
               if "->" in line.split() and any(field.endswith(inode) for field in line.split()))


def _until(predicate, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "the lock never got there"
        time.sleep(0.01)


def test_an_alone_test_waits_for_the_shared_one_and_the_next_shared_one_waits_for_it(monkeypatch, tmp_path):
    run_id = uuid.uuid4().hex
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", run_id)
    lock, turnstile = (tmp_path / f"cputrain-tests-{run_id}.{kind}" for kind in ("lock", "turnstile"))
    ran: list[str] = []

    def a_test(name: str, alone: bool) -> threading.Thread:
        def run():
            with alone_or_shared(alone, tmp_path):
                ran.append(name)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    with alone_or_shared(False, tmp_path):  # a shared test runs
        alone = a_test("alone", True)
        _until(lambda: _waiting_on(lock) == 1)  # it waits for the machine, holding the turnstile
        shared = a_test("next shared", False)
        _until(lambda: _waiting_on(turnstile) == 1)  # it waits behind the alone test
        assert ran == []
    alone.join(30)
    shared.join(30)
    assert ran == ["alone", "next shared"]
