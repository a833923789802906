"""To a torchrun agent, the rank stand-in (rank_python.py, its PYTHON_EXEC) is the rank's process:
a signal sent to it reaches the rank, which ends with that signal's status; a rank killed ends its
stand-in the same way; a stand-in killed (SIGKILL cannot be forwarded) takes its rank with it, and
the rank server serves on. Nothing is left to wait on. A stand-in inside a network namespace gets
its rank inside it.

The test's own rank server forks ranks of a stand-in `cputrain` package put first on its
PYTHONPATH: a rank that says it is ready and its pid, then waits, and reports a SIGTERM before
ending by it. What is tested is the protocol, not a training run.

The stand-in is also the `python` a forked command's multiprocessing spawns with: a spawned
process gets its pipes, its result and exit code reach its parent, it sees that parent as its
own, and it ends when the parent is killed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from harness.cli_env import cli_env
from harness.rank_server import RankServer

pytestmark = pytest.mark.slow  # the rank server imports torch and transformers first: seconds of CPU

RANK_MAIN = """\
import os, signal, sys, time


def report_and_end(received, _frame):
    print(f"rank {os.getpid()} got signal {received}", flush=True)
    signal.signal(received, signal.SIG_DFL)
    os.kill(os.getpid(), received)


signal.signal(signal.SIGTERM, report_and_end)
if sys.argv[1:2] == ["exit"]:
    sys.exit(int(sys.argv[2]))
print(f"rank {os.getpid()} ready", flush=True)
time.sleep(120)  # a test that fails leaves nothing for long
"""


# The spawning parent: a fresh interpreter (multiprocessing only, no torch) that spawns as a command
# forked by run_cli does (warm_interpreter._fork_spawns), its target in the stand-in package.
SPAWNED = """\
import os, sys, time


def work(connection, code):
    connection.send((os.getpid(), os.getppid()))
    if code == "wait":
        time.sleep(120)  # a test that fails leaves nothing for long
    sys.exit(int(code))
"""
SPAWNER = """\
import multiprocessing, os, sys
import spawned

if __name__ == "__main__":
    multiprocessing.set_executable(os.environ["PYTHON_EXEC"])
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("spawn").Process(target=spawned.work, args=(send, sys.argv[1]))
    child.start()
    send.close()
    pid, its_parent = receive.recv()
    print(child.pid, pid, its_parent, os.getpid(), flush=True)
    child.join()
    print("exit", child.exitcode, flush=True)
"""


@pytest.fixture(scope="module")
def rank_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ranks")
    package = folder / "stand-in-package" / "cputrain"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(RANK_MAIN)
    (package.parent / "spawned.py").write_text(SPAWNED)
    (package.parent / "spawner.py").write_text(SPAWNER)
    path = os.pathsep.join(p for p in (str(package.parent), os.environ.get("PYTHONPATH", "")) if p)
    with open(folder / "server.log", "w") as log:
        server = RankServer(folder, log, cli_env(PYTHONPATH=path))
        deadline = time.monotonic() + 300
        while not Path(f"{server.socket}.ranks").is_dir():  # made once the socket listens
            assert server.process.poll() is None, (folder / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the rank server did not start listening"
            time.sleep(0.1)
        yield server
        server.close()


@pytest.fixture
def start_rank(rank_server, tmp_path):
    """`start_rank(*argv, netns=None)` does what the agent does for a rank: starts its `python -u -m
    cputrain ARGV` (inside network namespace `netns`, as a node's agent of the multi-node tests
    does), here the stand-in; returns it and the file of its output. A stand-in or rank a failed
    test leaves running is killed after it."""
    started: list[subprocess.Popen] = []

    def start(*argv: str, netns: str | None = None) -> tuple[subprocess.Popen, Path]:
        out = tmp_path / f"rank-{uuid.uuid4().hex[:8]}.out"
        inside = ["ip", "netns", "exec", netns] if netns else []  # it execs the stand-in: the same pid
        with open(out, "w") as stdout:
            started.append(subprocess.Popen([*inside, str(rank_server.python), "-u", "-m", "cputrain", *argv],
                                            stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT,
                                            env=cli_env(**rank_server.exec_env())))
        return started[-1], out

    yield start
    for stand_in in started:  # a rank's record lasts until the server has reaped it
        for pid in (rank_server.forked_rank(stand_in.pid), None if stand_in.poll() is not None else stand_in.pid):
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        stand_in.wait(timeout=30)


def _ready_rank(server: RankServer, stand_in: subprocess.Popen, out: Path) -> int:
    """The pid of the rank once it says it is ready; the server forked it for this stand-in."""
    deadline = time.monotonic() + 60
    while "ready" not in out.read_text():
        assert stand_in.poll() is None, f"the stand-in ended ({stand_in.returncode}): {out.read_text()}"
        assert time.monotonic() < deadline, out.read_text()
        time.sleep(0.05)
    rank = int(out.read_text().split()[1])
    assert rank != stand_in.pid and server.forked_rank(stand_in.pid) == rank
    return rank


def _gone(pid: int, within_s: float = 30) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_signal_to_the_stand_in_reaches_the_rank_which_ends_by_it(rank_server, start_rank):
    stand_in, out = start_rank("wait")
    rank = _ready_rank(rank_server, stand_in, out)
    stand_in.send_signal(signal.SIGTERM)
    assert stand_in.wait(timeout=30) == -signal.SIGTERM
    assert f"rank {rank} got signal {int(signal.SIGTERM)}" in out.read_text()
    assert _gone(rank)


def test_a_rank_killed_ends_its_stand_in_by_the_same_signal(rank_server, start_rank):
    stand_in, out = start_rank("wait")
    rank = _ready_rank(rank_server, stand_in, out)
    os.kill(rank, signal.SIGKILL)
    assert stand_in.wait(timeout=30) == -signal.SIGKILL  # what the agent sees of a rank lost with its node
    assert rank_server.forked_rank(stand_in.pid) is None  # the server has reaped it


def test_a_killed_stand_in_takes_its_rank_with_it_and_the_server_serves_on(rank_server, start_rank):
    stand_in, out = start_rank("wait")
    rank = _ready_rank(rank_server, stand_in, out)
    stand_in.kill()
    assert stand_in.wait(timeout=30) == -signal.SIGKILL
    assert _gone(rank), f"rank {rank} outlived its stand-in"
    next_rank, _ = start_rank("exit", "3")
    assert next_rank.wait(timeout=30) == 3  # its exit code, through the same server


def test_a_stand_in_gone_before_its_answer_leaves_the_server_serving(rank_server, start_rank):
    """A stand-in killed as it starts (its parent killed: a spawned process's stand-in ends with it)
    may have sent its request and be gone before the answer: the server kills what it forked for
    it and serves the next rank, instead of ending on the broken connection."""
    gone = subprocess.Popen([sys.executable, "-S", "-c", "pass"])
    gone.wait()
    request = {"argv": ["-u", "-m", "cputrain", "wait"], "cwd": os.getcwd(), "env": cli_env(), "stand_in": gone.pid,
               "parent": os.getpid(), "fds": [0, 1, 2]}
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(str(rank_server.socket))
    with open(os.devnull, "rb") as null_in, open(os.devnull, "wb") as null_out:
        socket.send_fds(conn, [json.dumps(request).encode()], [null_in.fileno(), null_out.fileno(), null_out.fileno()])
    conn.close()  # before the server answers
    next_rank, _ = start_rank("exit", "3")
    assert next_rank.wait(timeout=30) == 3
    assert rank_server.process.poll() is None


def test_a_stand_in_inside_a_network_namespace_gets_its_rank_inside_it(rank_server, start_rank):
    """A node of the multi-node tests runs its agent with `ip netns exec`: the rank forked for its
    stand-in enters the stand-in's namespace, so its sockets are the node's (its link, its loopback)
    and the node's processes (`ip netns pids`, what a test kills to lose a node) include it."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network namespace needs root and `ip` (iproute2)")
    ns = f"crs{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        stand_in, out = start_rank("wait", netns=ns)
        rank = _ready_rank(rank_server, stand_in, out)
        node = os.readlink(f"/proc/{stand_in.pid}/ns/net")
        assert node != os.readlink("/proc/self/ns/net")
        assert os.readlink(f"/proc/{rank}/ns/net") == node
        listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        assert str(rank) in listed and str(stand_in.pid) in listed, listed
        stand_in.kill()
        assert stand_in.wait(timeout=30) == -signal.SIGKILL
        assert _gone(rank), f"rank {rank} outlived its stand-in"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _spawner(server: RankServer, code: str, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"spawner-{uuid.uuid4().hex[:8]}.out"
    package = server.socket.parent / "stand-in-package"
    with open(out, "w") as stdout:
        spawner = subprocess.Popen([sys.executable, str(package / "spawner.py"), code], cwd=package,
                                   stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.STDOUT,
                                   env=cli_env(PYTHONPATH=str(package), **server.exec_env()))
    return spawner, out


def _spawned_line(spawner: subprocess.Popen, out: Path) -> list[int]:
    deadline = time.monotonic() + 60
    while not out.read_text().strip():
        assert spawner.poll() is None, f"the spawner ended ({spawner.returncode}): {out.read_text()}"
        assert time.monotonic() < deadline, "the spawned process sent nothing"
        time.sleep(0.05)
    return [int(word) for word in out.read_text().split()[:4]]


def test_a_spawned_process_is_forked_and_answers_its_parent_as_a_spawned_one(rank_server, tmp_path):
    spawner, out = _spawner(rank_server, "3", tmp_path)
    assert spawner.wait(timeout=60) == 0, out.read_text()
    stand_in, spawned, its_parent, parent = _spawned_line(spawner, out)
    assert spawned != stand_in  # the server forked it: not a fresh interpreter in the stand-in's place
    assert its_parent == parent  # os.getppid(): the process that spawned it, not the server
    assert out.read_text().split()[-2:] == ["exit", "3"]  # its exit code, through the stand-in


def test_a_spawned_process_ends_when_its_parent_is_killed(rank_server, tmp_path):
    spawner, out = _spawner(rank_server, "wait", tmp_path)
    spawned = None
    try:
        stand_in, spawned, _, _ = _spawned_line(spawner, out)
        assert rank_server.forked_rank(stand_in) == spawned
        spawner.kill()  # what a lost node does to a data preparation: no signal to forward
        assert _gone(stand_in) and _gone(spawned), f"{spawned} outlived the process that spawned it"
    finally:
        if spawned is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(spawned, signal.SIGKILL)
        spawner.kill()
        spawner.wait(timeout=30)
