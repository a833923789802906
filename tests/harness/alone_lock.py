"""Under pytest-xdist, a test marked `alone` runs while no other worker runs a test; every other
test shares the machine. A readers-writer lock on a file of this run (flock: released by the
kernel if a worker dies), with a turnstile so a waiting `alone` test is not starved by the other
worker's next tests. Both files live in the run's shared folder (harness.shared_builds), which goes
when the run ends."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def alone_or_shared(alone: bool, folder: Path):
    """Held while one test runs: the whole machine if `alone`, else a share of it (its lock files
    in `folder`, one per run of the suite)."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:  # one process: nothing runs beside this test
        yield
        return
    import fcntl

    with open(folder / f"cputrain-tests-{run_id}.turnstile", "w") as turnstile, \
            open(folder / f"cputrain-tests-{run_id}.lock", "w") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield
