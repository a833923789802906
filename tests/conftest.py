"""The suite's hooks and shared fixtures; what they use lives in tests/harness/ (its README says
how the warm interpreter, the tiers and the budget work).

Tests import what they use from its harness module (`from harness.run_cli import run_cli`),
never from this file: pytest alone imports it. The running test's tier, which the autouse fixture
below sets and the runners read, lives in `harness.tiers`, one module under one name.
"""

from __future__ import annotations

import os

if "PYTEST_XDIST_WORKER" in os.environ:
    # The tests that run torch in this process share the 2 cores with the other worker: OpenMP
    # threads that spin while they wait (libgomp's default) burn each other's time slices, as
    # harness.cli_env says for the commands. Set before torch loads libgomp, which reads it then.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import tempfile

# The machine cache (the matmul peak each run's MFU is measured against, timed once per dtype and
# thread count) belongs to the session, not to the home folder: a session's time and figures do
# not depend on what an earlier one left there, as on CI's fresh machines. Set where pytest starts
# (xdist's controller), its workers inherit it: each peak is timed once a session.
# The session that sets it removes it at its end.
_MACHINE_CACHE_RUN_DIR = None
if "CPUTRAIN_CACHE_HOME" not in os.environ:
    _MACHINE_CACHE_RUN_DIR = os.path.join(tempfile.gettempdir(), f"cputrain-tests-{os.getpid()}")
    os.environ["CPUTRAIN_CACHE_HOME"] = os.path.join(_MACHINE_CACHE_RUN_DIR, "machine-cache")

import shutil
import time
from pathlib import Path

import pytest

from harness import budget, tiers
from harness.alone_lock import alone_or_shared
from harness.chat_data import write_chat_file
from harness.repo import SHARED
from harness.run_cli import run_cli
from harness.shared_builds import built_once, remove_shared_root, shared_root
from harness.tiny_model import make_tiny_model, shape_key
from harness.tiny_run import tiny_overrides
from harness.warm_client import close_warm


def pytest_report_header(config):
    return f"cpu: {budget.cpu_line()}"


def pytest_sessionstart(session):
    if _times_the_machine(session.config):  # before the clock starts: the suite's time is its tests'
        session.config.stash[budget.MATMUL_AT_START] = budget.matmul_gflops()
    session.config.stash[budget.STARTED] = time.monotonic()


def _times_the_machine(config) -> bool:
    """The session that reports (not an xdist worker) of a run that includes the slow tier: its time
    is read against the budget, so it says the machine's speed too (~1 s)."""
    return not hasattr(config, "workerinput") and "not slow" not in (config.getoption("markexpr") or "")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    timed = _times_the_machine(config)
    budget.report_wall_time(terminalreporter, time.monotonic() - config.stash.get(budget.STARTED, time.monotonic()),
                            config.stash.get(budget.MATMUL_AT_START, None) if timed else None,
                            budget.matmul_gflops() if timed else None)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if tiers.in_slow_folder(item.fspath):
            item.add_marker(pytest.mark.slow)


def pytest_sessionfinish(session, exitstatus):
    close_warm()
    remove_shared_root(session.config)
    if _MACHINE_CACHE_RUN_DIR is not None:  # set by this process: the session that started the workers
        shutil.rmtree(_MACHINE_CACHE_RUN_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _tier_of_this_test(request):
    tiers.enter(request.node)
    yield
    tiers.leave()


@pytest.fixture(autouse=True)
def _alone_or_shared(request, tmp_path_factory):
    with alone_or_shared(request.node.get_closest_marker("alone") is not None, shared_root(tmp_path_factory)):
        yield


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One data/tokenizer cache for the whole run, shared by the xdist workers: each tokenizer and
    token cache is built once, by the first run that needs it, under cputrain's own cache locks
    (the ones a node's ranks share it by)."""
    folder = shared_root(tmp_path_factory) / "cache"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, cache_dir):
    """`trained_run(dest, **overrides)` puts at `dest` a copy of the tiny run with these overrides
    (on top of tiny_overrides; `nproc_per_node=N` starts N ranks), trained once per run of the
    suite (harness.shared_builds). Reference runs that several tests compare against are trained
    once, not once per file or worker."""
    root = shared_root(tmp_path_factory)

    def copy_of(dest: Path, nproc_per_node: int = 1, **overrides) -> None:
        key = [nproc_per_node, sorted((k, str(v)) for k, v in overrides.items())]
        flags = ["--nproc-per-node", str(nproc_per_node)] if nproc_per_node > 1 else []
        src = built_once(root, "trained-run", key, lambda folder: run_cli(
            "train", *tiny_overrides(folder / "run", cache_dir, **overrides), *flags, check=True))
        shutil.copytree(src / "run", dest)

    return copy_of


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(**shape)`: the folder of make_tiny_model(…, **shape), built once per run of the
    suite and shape (harness.shared_builds). Shared: copy it before changing a file in it."""
    root = shared_root(tmp_path_factory)

    def folder_of(**shape) -> Path:
        return built_once(root, "tiny-model", shape_key(**shape), lambda f: make_tiny_model(f / "model", **shape)) \
            / "model"

    return folder_of


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model) -> Path:
    return tiny_model()


@pytest.fixture
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (shared data and schemas live beside the repository)")
    return SHARED


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory):
    """Conversations of very different lengths, some with a system prompt and two turns
    (harness.chat_data)."""
    return write_chat_file(tmp_path_factory.mktemp("chat") / "chat.jsonl")
