"""Shared fixtures: tiny models built from a config, tokenizers trained here, the CLI as a
subprocess or in this process, runs trained once per session.

No test reaches a model hub: a "pretrained" model is a LlamaConfig saved with save_pretrained,
and its tokenizer a BPE trained with `tokenizers` on Python's own documentation.

Tiers. A test in tests/e2e or tests/distributed is `slow` by its folder; a test elsewhere that
starts a training process (or an agent) must be marked `slow` itself, and `run_cli` fails it if it
is not, so `make test-fast` (`-m "not slow"`) never waits for a training run.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Self

import pytest

# pytest (--import-mode=importlib) loads this file as `tests.conftest`; tests and helpers import it
# as `conftest` (pythonpath). One module for both names: else run_cli's tier and fresh-interpreter
# flags (set by the fixtures below, in pytest's copy) and its warm interpreter would be a second
# copy's, which those fixtures never reach.
sys.modules.setdefault("conftest", sys.modules[__name__])

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TESTS = Path(__file__).resolve().parent
SLOW_FOLDERS = ("e2e", "distributed")  # every test there starts training processes


# The full suite's budget on the slowest machine kind CI gets, a 2-core AVX2-only CPU (README, Tests).
BUDGET_S = 30 * 60
WARN_AFTER_S = 45 * 60  # half of CI's 90 minutes: said at the end of the run, not a failure


def _cpu() -> str:
    """The machine in one line, from cputrain's own detection (the flags `cputrain doctor` prints)."""
    from cputrain.hardware import detect

    hw = detect()
    return f"{hw.cpu_model}, {hw.physical_cores} cores, " + " ".join(
        f"{flag}={'yes' if on else 'no'}" for flag, on in hw.flags.items())


def pytest_report_header(config):
    return f"cpu: {_cpu()}"


def pytest_sessionstart(session):
    session.config.stash[_STARTED] = time.monotonic()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    elapsed_s = time.monotonic() - config.stash.get(_STARTED, time.monotonic())
    terminalreporter.write_line(f"suite wall time: {elapsed_s:.0f} s on {_cpu()} "
                                f"(budget: {BUDGET_S // 60} min on a 2-core AVX2-only CPU)")
    if elapsed_s > WARN_AFTER_S:
        terminalreporter.write_line(
            f"warning: the suite took {elapsed_s / 60:.0f} min, past {WARN_AFTER_S // 60} of CI's 90; its budget is "
            f"{BUDGET_S // 60} min on a 2-core AVX2-only CPU (README, Tests): make the new tests cheaper", yellow=True)


_STARTED = pytest.StashKey[float]()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0] in SLOW_FOLDERS:
            item.add_marker(pytest.mark.slow)


_TIER = {"slow": True, "fresh": False}  # the running test's tier and markers, read by run_cli


@pytest.fixture(autouse=True)
def _tier_of_this_test(request):
    _TIER["slow"] = request.node.get_closest_marker("slow") is not None
    _TIER["fresh"] = request.node.get_closest_marker("fresh_interpreter") is not None
    yield
    _TIER.update(slow=True, fresh=False)


class _WarmInterpreter:
    """The client of tests/warm_interpreter.py: one server per test process, started on first use."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="cputrain-warm-"))
        self.log = open(self.folder / "server.log", "w")  # noqa: SIM115 (open while the server lives)
        # The ranks of a command's torchrun agent are forked by a second warm server; the agent runs
        # tests/rank_python.py as their `python` (torchrun's PYTHON_EXEC).
        self.rank_socket = self.folder / "ranks.sock"
        self.rank_server = subprocess.Popen([sys.executable, str(TESTS / "warm_interpreter.py"), "--ranks",
                                             str(self.rank_socket)], cwd=REPO, env=cli_env(), stdin=subprocess.PIPE,
                                            stdout=self.log, stderr=self.log)
        python = self.folder / "rank-python"
        python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{TESTS / "rank_python.py"}" "$@"\n')
        python.chmod(0o755)
        env = cli_env(PYTHON_EXEC=python, CPUTRAIN_TEST_RANK_SERVER=self.rank_socket)
        self.server = subprocess.Popen([sys.executable, str(TESTS / "warm_interpreter.py")], cwd=REPO, env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.calls = 0

    def forked_rank(self, pid: int) -> int | None:
        """The rank a process started as tests/rank_python.py stands in for (None: not such a process)."""
        with contextlib.suppress(OSError, ValueError):
            return int((self.folder / "ranks.sock.ranks" / str(pid)).read_text())
        return None

    def _answer(self, key: str, timeout_s: float | None):
        import select

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.server.stdout], [], [], wait)[0]:
                return None
            line = self.server.stdout.readline()
            if not line:
                raise RuntimeError(f"the warm interpreter ended: {(self.folder / 'server.log').read_text()[-2000:]}")
            with contextlib.suppress(ValueError):
                answer = json.loads(line)
                if key in answer:
                    return answer[key]

    def start(self, argv: list[str], cwd) -> tuple[int, Path, Path]:
        """Fork `python -m cputrain ARGV`; its pid and the files of its stdout and stderr. The
        server forks nothing else until returncode() has answered for it."""
        self.calls += 1
        out, err = self.folder / f"{self.calls}.out", self.folder / f"{self.calls}.err"
        self.server.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "stdout": str(out),
                                            "stderr": str(err)}) + "\n")
        self.server.stdin.flush()
        return self._answer("pid", None), out, err

    def returncode(self, timeout_s: float | None) -> int | None:
        """The exit code of the started command, or None if it has not ended within timeout_s."""
        return self._answer("returncode", timeout_s)

    def run(self, argv: list[str], cwd, timeout_s: float) -> subprocess.CompletedProcess:
        pid, out, err = self.start(argv, cwd)
        code = self.returncode(timeout_s)
        timed_out = code is None
        if timed_out:  # as subprocess.run does: kill it, then raise
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            self._answer("returncode", None)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        cmd = [sys.executable, "-m", "cputrain", *argv]
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout_s, stdout, stderr)
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)

    def close(self):
        self.server.stdin.close()
        self.server.wait(timeout=30)
        self.rank_server.stdin.close()
        self.rank_server.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_WARM: list[_WarmInterpreter] = []


def with_forked_ranks(processes: list) -> list:
    """`processes` (psutil) and, for each that stands in for a rank the warm rank server forked,
    that rank: it is not under the agent in the process tree, nor named by its command line."""
    import psutil

    ranks = []
    for p in processes:
        pid = _WARM[0].forked_rank(p.pid) if _WARM else None
        with contextlib.suppress(psutil.NoSuchProcess):
            if pid is not None:
                ranks.append(psutil.Process(pid))
    return [*ranks, *processes]


def _warm() -> _WarmInterpreter:
    if not _WARM:
        _WARM.append(_WarmInterpreter())
    return _WARM[0]


def pytest_sessionfinish(session, exitstatus):
    for warm in _WARM:
        warm.close()


@pytest.fixture(autouse=True)
def _alone_or_shared(request):
    """Under pytest-xdist, a test marked `alone` runs while no other worker runs a test; every other
    test shares the machine. A readers-writer lock on a file of this run (flock: released by the
    kernel if a worker dies), with a turnstile so a waiting `alone` test is not starved by the
    other worker's next tests."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:  # one process: nothing runs beside this test
        yield
        return
    import fcntl

    alone = request.node.get_closest_marker("alone") is not None
    folder = Path(tempfile.gettempdir())
    with open(folder / f"cputrain-tests-{run_id}.turnstile", "w") as turnstile, \
            open(folder / f"cputrain-tests-{run_id}.lock", "w") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield


def _starts_training(args) -> bool:
    words = [str(a) for a in args]
    return bool(words) and words[0] == "train" and not {"--dry-run", "--help-config", "-h", "--help"} & set(words)


# The smallest model that still has every part of a Llama (GQA, RoPE, SwiGLU, tied embeddings).
TINY_ARCH = [
    "model.arch.model_type=llama",
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=128",
    "model.arch.num_hidden_layers=2",
    "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=2",
    "model.arch.max_position_embeddings=128",
    "model.arch.tie_word_embeddings=true",
    "model.tokenizer_vocab_size=512",
]


def tiny_overrides(out_dir, cache_dir, **extra) -> list[str]:
    """key=value overrides for a run that takes seconds: tiny model, short sequences, few docs."""
    base = {
        "output_dir": str(out_dir),
        "data.cache_dir": str(cache_dir),
        "data.seq_len": 32,
        "data.max_documents": 400,
        "train.max_steps": 10,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 4,
        "train.warmup_steps": 2,
        "train.log_every": 1,
        "train.eval_every": 5,
        "train.eval_batches": 2,
        "train.checkpoint_every": 5,
        "train.sample_tokens": 0,
        "hardware.precision": "fp32",
        "hardware.threads": 1,
        # auto times both kernels in every run and may pick either: runs compared loss by loss
        # must run the same one (tests/e2e/test_bf16_parity.py exercises auto)
        "model.attn_implementation": "sdpa",
        # auto would start a one-process run a second time with tcmalloc preloaded where it is
        # installed (tests/unit/test_placement.py tests that re-exec)
        "hardware.allocator": "system",
    }
    base.update(extra)
    return TINY_ARCH + [f"{k}={v}" for k, v in base.items()]


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    if "PYTEST_XDIST_WORKER" in os.environ:
        # Two tests share the 2 cores: OpenMP threads that spin while they wait (libgomp's default)
        # would take turns burning each other's time slices. Passive waiting changes no result.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_cli(*args, cwd=None, env=None, timeout=600, check=False, fresh=False) -> subprocess.CompletedProcess:
    """`python -m cputrain ARGS` in a process of its own, as a user would run it: forked from a
    warm interpreter (tests/warm_interpreter.py) that has imported torch and transformers, or a
    fresh interpreter where the call sets its own environment, asks for one (`fresh`), or the test
    is marked `fresh_interpreter` (it measures a process's memory)."""
    if not _TIER["slow"] and _starts_training(args):
        pytest.fail("this test starts a training process: mark it @pytest.mark.slow (or move it to tests/e2e)")
    argv = [str(a) for a in args]
    if env is None and not fresh and not _TIER["fresh"]:
        proc = _warm().run(argv, cwd or REPO, timeout)
    else:
        proc = subprocess.run(
            [sys.executable, "-m", "cputrain", *argv],
            cwd=cwd or REPO, env=env or cli_env(), capture_output=True, text=True, timeout=timeout,
        )
    if check and proc.returncode != 0:
        raise AssertionError(f"cputrain {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


class WarmProcess:
    """A `cputrain` command forked from the warm interpreter and not waited for (start_cli): a test
    reads its stderr while it runs, signals it, then waits for its exit code. As a context
    manager, a command still running at the end is killed with everything under it."""

    def __init__(self, argv: list[str], cwd):
        self.pid, self._out, self._err = _warm().start(argv, cwd)
        self.returncode: int | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        if self.returncode is None:
            self.kill_tree()

    @staticmethod
    def _text(path: Path) -> str:
        return path.read_text(errors="replace") if path.exists() else ""  # the child opens it after the fork

    def stderr(self) -> str:
        """What it has written to stderr so far (all of it once it has ended)."""
        return self._text(self._err)

    def stdout(self) -> str:
        return self._text(self._out)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _warm().returncode(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = _warm().returncode(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"cputrain (pid {self.pid})", timeout, None, self.stderr())
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """(stdout, stderr) once it has ended, as Popen.communicate gives them; past `timeout` it is
        killed with everything under it (the warm interpreter must not wait on it for the next
        test), then TimeoutExpired."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            raise
        return self.stdout(), self.stderr()

    def kill_tree(self) -> None:
        """SIGKILL to the command and every process under it, as a node loss would: each is
        stopped first (so none starts another or sees another die), then all are killed."""
        import psutil

        stopped: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.pid)
            while new := [p for p in with_forked_ranks([root, *root.children(recursive=True)]) if p.pid not in stopped]:
                for p in new:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.send_signal(signal.SIGSTOP)
                    stopped[p.pid] = p
        for p in stopped.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        self.wait(60)


def start_cli(*args, cwd=None) -> WarmProcess:
    """`python -m cputrain ARGS` forked from the warm interpreter, as run_cli does, but not waited
    for: for a test that signals a command while it works. One at a time: wait for it (or kill
    it) before the next run_cli; use it as a context manager so a failing test leaves nothing
    running."""
    if not _TIER["slow"] and _starts_training(args):
        pytest.fail("this test starts a training process: mark it @pytest.mark.slow (or move it to tests/e2e)")
    return WarmProcess([str(a) for a in args], cwd or REPO)


class _ReachedWork(AssertionError):
    pass


def _no_work(*_args, **_kwargs):
    raise _ReachedWork("the command was not refused before work: it reached the worker or the agent "
                       "(test it with run_cli, in its own process)")


@contextlib.contextmanager
def _process_state(env: dict | None, cwd):
    """os.environ, the working folder and the logging set-up as they were, after the call."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    loggers = {name: (lg.handlers[:], lg.level, lg.propagate)
               for name in ("cputrain", "py.warnings") for lg in [logging.getLogger(name)]}
    saved_format, capturing = warnings.formatwarning, logging._warnings_showwarning is not None
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    if cwd is not None:
        os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        for name, (handlers, level, propagate) in loggers.items():
            lg = logging.getLogger(name)
            lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
        warnings.formatwarning = saved_format
        logging.captureWarnings(capturing)


def run_cli_here(*args, env: dict | None = None, cwd=None, check: bool = False) -> subprocess.CompletedProcess:
    """The command's entry function (`cputrain.cli.main`) in this process, its stdout, stderr
    and exit code captured as run_cli returns them: for what is refused before any work (config
    keys and values, flags, model-folder and run-folder checks, k8s and plan options). A `train`
    that gets past the checks fails the test instead of training here. `env`: variables to set
    (the launchers' rank variables are unset, as run_cli's environment has them)."""
    from unittest import mock

    from cputrain import cli

    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with _process_state(env, cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            mock.patch("cputrain.training.worker.run_worker", _no_work), mock.patch("cputrain.training.launch.run_agent", _no_work):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code if isinstance(exit_.code, int) else 1
    if check and code != 0:
        raise AssertionError(f"cputrain {' '.join(argv)} failed ({code}):\n{err.getvalue()[-4000:]}")
    return subprocess.CompletedProcess(["cputrain", *argv], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One data/tokenizer cache for the whole session: tokenizers are trained once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, cache_dir):
    """`trained_run(dest, **overrides)` puts at `dest` a copy of the tiny run with these overrides
    (on top of tiny_overrides; `nproc_per_node=N` starts N ranks), trained once per session and
    returns the CompletedProcess of that training. Reference runs that several tests compare
    against are trained once, not once per file."""
    trained: dict[tuple, tuple[Path, subprocess.CompletedProcess]] = {}

    def copy_of(dest: Path, nproc_per_node: int = 1, **overrides) -> subprocess.CompletedProcess:
        key = (nproc_per_node, tuple(sorted((k, str(v)) for k, v in overrides.items())))
        if key not in trained:
            out = tmp_path_factory.mktemp("trained") / "run"
            flags = ["--nproc-per-node", str(nproc_per_node)] if nproc_per_node > 1 else []
            proc = run_cli("train", *tiny_overrides(out, cache_dir, **overrides), *flags, check=True)
            trained[key] = (out, proc)
        src, proc = trained[key]
        shutil.copytree(src, dest)
        return proc

    return copy_of


_TOKENIZERS: dict[int, Path] = {}  # vocab size → a tokenizer trained once per process
_TOKENIZER_HOME = tempfile.TemporaryDirectory(prefix="cputrain-tests-tokenizers-")


def _train_tokenizer(folder: Path, vocab_size: int = 512):
    """The BPE of `vocab_size` tokens on Python's documentation, trained once per process and
    saved again at `folder`."""
    from transformers import AutoTokenizer

    from cputrain.data.sources import _pydoc_documents
    from cputrain.data.tokenizer import train_bpe

    if vocab_size not in _TOKENIZERS:
        _TOKENIZERS[vocab_size] = Path(_TOKENIZER_HOME.name) / str(vocab_size)
        train_bpe(_pydoc_documents()[:400], vocab_size, _TOKENIZERS[vocab_size])
    shutil.copytree(_TOKENIZERS[vocab_size], folder, dirs_exist_ok=True)
    return AutoTokenizer.from_pretrained(folder)


def make_tiny_model(folder: Path, vocab_size: int = 512, hidden: int = 64, layers: int = 2, seed: int = 0,
                    tie: bool = True, dtype=None) -> Path:
    """A Llama saved as a Hugging Face folder (config.json, model.safetensors, tokenizer), its
    weights in `dtype` (default fp32; Llama-3's published files are bf16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(folder / "_tok", vocab_size)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(folder)  # safetensors by default
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(**shape)`: the folder of make_tiny_model(…, **shape), built once per session and
    shape. Shared: copy it before changing a file in it."""
    built: dict[tuple, Path] = {}

    def folder_of(**shape) -> Path:
        import inspect

        bound = inspect.signature(make_tiny_model).bind(None, **shape)
        bound.apply_defaults()  # tiny_model(hidden=64) is tiny_model()
        key = tuple((k, str(v)) for k, v in bound.arguments.items() if k != "folder")
        if key not in built:
            built[key] = make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "model", **shape)
        return built[key]

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
    """Conversations of very different lengths (answers of a few words to a few paragraphs), some
    with a system prompt and two turns, so micro-batches hold different numbers of trained tokens."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    with open(path, "w") as f:
        for i, name in enumerate(sorted(topics)):
            paragraphs = [" ".join(p.split()) for p in topics[name].split("\n\n") if len(p.strip()) > 40]
            answer = " ".join(paragraphs[: 1 + i % 3])[: 40 + 60 * (i % 5)]
            messages = [{"role": "user", "content": f"What is {name}?"}, {"role": "assistant", "content": answer}]
            if i % 3 == 0:
                messages = [{"role": "system", "content": "Answer briefly."}] + messages + [
                    {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def sft_overrides(chat_file) -> dict:
    """What turns tiny_overrides into a chat fine-tuning run on `chat_file`."""
    return {"data.source": chat_file, "data.format": "auto", "data.seq_len": 96, "data.max_documents": 80,
            "data.val_fraction": 0.1, "model.arch.max_position_embeddings": 128}
