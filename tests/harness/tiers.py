"""Tiers. A test in tests/e2e or tests/distributed is `slow` by its folder; a test elsewhere that
starts a training process (or an agent) must be marked `slow` itself, and the runners fail it if it
is not, so `make test-fast` (`-m "not slow"`) never waits for a training run.

The running test's tier and markers live here, in one module that conftest's autouse fixture sets
and the runners read: whoever imports `harness.tiers` sees the same `RUNNING`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.repo import TESTS

SLOW_FOLDERS = ("e2e", "distributed")  # every test there starts training processes

# The running test's tier (`slow`) and whether it is marked `fresh_interpreter`; between tests,
# as a test outside pytest's run would have them.
RUNNING = {"slow": True, "fresh": False}


def in_slow_folder(path) -> bool:
    return Path(str(path)).resolve().relative_to(TESTS).parts[0] in SLOW_FOLDERS


def enter(node) -> None:
    """`node`'s markers become the running test's."""
    RUNNING["slow"] = node.get_closest_marker("slow") is not None
    RUNNING["fresh"] = node.get_closest_marker("fresh_interpreter") is not None


def leave() -> None:
    RUNNING.update(slow=True, fresh=False)


def starts_training(args) -> bool:
    words = [str(a) for a in args]
    return bool(words) and words[0] == "train" and not {"--dry-run", "--help-config", "-h", "--help"} & set(words)


def refuse_training_in_fast_tier(args) -> None:
    """Fail the running test if it is not slow and `cputrain ARGS` would train."""
    if not RUNNING["slow"] and starts_training(args):
        pytest.fail("this test starts a training process: mark it @pytest.mark.slow (or move it to tests/e2e)")
