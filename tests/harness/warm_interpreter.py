"""`python -m cputrain ARGS` without paying for the imports each time: a warm interpreter forks.

Each `cputrain` command a test starts is a fresh interpreter that spends ~4 s of CPU importing
torch and transformers before it reads its arguments (a tiny training run then takes ~1 s). This
server imports those libraries once, runs no torch operation (so no OpenMP pool or other thread
state is copied into a child), then for each request forks a child that becomes
`python -m cputrain ARGS`: its own pid, working folder, stdout and stderr files, exit code and
signals, and cputrain itself imported fresh in the child (the server never imports it). What it
cannot give is a different environment at import time, so a run_cli call with its own `env`, and
a test that measures a process's memory, start a fresh interpreter instead (harness.run_cli).

Protocol, one JSON object per line: the request {"argv", "cwd", "stdout", "stderr"} (the two
output paths are files the child writes) and optionally "environ" (the child's whole environment,
set before cputrain is imported: run_cli's fresh="ranks" sends one without the rank server's
PYTHON_EXEC, so that the agent's ranks start as fresh interpreters); the answers {"pid"} at once
and {"returncode"} when the child has ended (negative: the signal that ended it, as subprocess
reports it).

`--ranks SOCKET` serves the ranks a torchrun agent starts (tests/harness/rank_python.py is the `python`
the agent runs, through torchrun's PYTHON_EXEC): over a unix socket, each request brings the
rank's argv, working folder, environment and its stdin/stdout/stderr, and the child becomes that
rank. Ranks run side by side, so this server never waits on one: it reaps children as they end
and answers each rank's own connection. A connection that closes before its child ended means
the agent killed the rank's stand-in (SIGKILL cannot be forwarded): the child is killed too.
A stand-in inside a network namespace (`ip netns exec`) gets a rank inside it: the child joins the
stand-in's namespace first (setns).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

# What every cputrain command that trains, evaluates or samples imports first: the bulk of its
# start-up. cputrain's own modules are not imported here, so no state of theirs is inherited.
import numpy  # noqa: F401
import safetensors.torch  # noqa: F401
import tokenizers  # noqa: F401
import torch.distributed  # noqa: F401 (binds torch too)
import transformers  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401

# …and what most of them import next: the config validator, the run folder's fsspec, the loss
# plot (cputrain.metrics.plot selects Agg the same way), the progress bar and process tools,
# LoRA's peft. Each forked command paid for these again (~0.5 s of CPU a tiny run, measured with
# -X importtime); none of them reads the environment a test may change, or starts a thread.
import fsspec  # noqa: F401
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot  # noqa: E402,F401
import peft  # noqa: E402,F401
import psutil  # noqa: E402,F401
import pydantic  # noqa: E402,F401
import tqdm  # noqa: E402,F401
import yaml  # noqa: E402,F401


def _exit_as_main(run) -> None:
    """Run `run` as an interpreter runs its main program, then exit this (forked) process with
    the code the interpreter would: SystemExit's, or 1 and the traceback."""
    code = 0
    try:
        run()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (any uncaught exception: the traceback and exit 1, as the interpreter does)
        import traceback

        traceback.print_exc()
        code = 1
    import atexit

    atexit._run_exitfuncs()  # what an interpreter runs at exit (multiprocessing joins its children)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(ValueError):  # closed by the program (multiprocessing's resource tracker does)
            stream.flush()
    os._exit(code)


def _become_cputrain(argv: list[str], unbuffered: bool = False) -> None:
    """Run `python -m cputrain ARGV` in this (forked) process and exit with its code."""
    import runpy

    if unbuffered:  # python -u, as torchrun starts its ranks
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    _fork_spawns()
    sys.argv = ["-m", *argv]  # run_module puts the module's path first, as `python -m` does
    _exit_as_main(lambda: runpy.run_module("cputrain", run_name="__main__", alter_sys=True))


def _child(request: dict) -> None:
    """Become `python -m cputrain ARGV`, its output in the request's files; with the request's
    "environ", in that environment (read by cputrain, imported after it, and by the processes it
    starts, but not by the libraries this server imported before)."""
    if "environ" in request:
        os.environ.clear()
        os.environ.update(request["environ"])
    if request.get("fork_spawns"):  # inherited by its agent's ranks too
        os.environ["CPUTRAIN_TEST_FORK_SPAWNS"] = "1"
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    _become_cputrain(request["argv"])


def main() -> None:
    reply = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        reply.write(json.dumps({"returncode": code}) + "\n")
        reply.flush()


def _join_network_namespace(stand_in: int) -> None:
    """A stand-in started inside a network namespace (a node of the multi-node tests, `ip netns
    exec`): its rank enters that namespace before anything opens a socket, so its traffic is the
    node's, on the node's links, and the node's processes (`ip netns pids`) include it."""
    theirs = f"/proc/{stand_in}/ns/net"
    try:
        if os.readlink(theirs) == os.readlink("/proc/self/ns/net"):
            return
    except FileNotFoundError:  # the stand-in is gone: the server kills this process as it answers it
        os._exit(1)
    import ctypes

    clone_newnet = 0x40000000
    fd = os.open(theirs, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the network namespace of {stand_in}")
    finally:
        os.close(fd)


def _fork_spawns() -> None:
    """A command started to be waited for (run_cli) spawns its processes (the data preparation's
    builder and its tokenizing workers) through the rank stand-in, forked here, not as fresh
    interpreters: its environment says so (CPUTRAIN_TEST_FORK_SPAWNS) and names the stand-in.
    A test that signals or kills a command's processes (start_cli) keeps them real processes."""
    stand_in = os.environ.get("PYTHON_EXEC")
    if os.environ.get("CPUTRAIN_TEST_FORK_SPAWNS") and stand_in and os.environ.get("CPUTRAIN_TEST_RANK_SERVER"):
        import multiprocessing

        multiprocessing.set_executable(stand_in)


def _run_program(argv: list[str], parent: int) -> None:
    """Run `python -c PROGRAM ARGS` (what multiprocessing spawns) in this process and exit with its
    code. Its parent is the process that spawned the stand-in: what os.getppid() answers (the
    data builder checks it is still there), and when that parent ends, the stand-in ends (its
    parent-death signal) and this process with it."""
    os.getppid = lambda: parent
    program = argv.index("-c")
    sys.argv = ["-c", *argv[program + 2:]]
    _fork_spawns()
    _exit_as_main(lambda: exec(compile(argv[program + 1], "<string>", "exec"), {"__name__": "__main__"}))


def _rank(request: dict, fds: list[int]) -> None:
    """Become the process the stand-in asked for: its streams and the other descriptors it was
    started with (at their numbers), its folder and environment, then `-u -m cputrain ARGS` (a
    rank) or `-c PROGRAM` (a process multiprocessing spawned)."""
    import fcntl
    import signal

    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    targets = request.get("fds", [0, 1, 2])
    # above every target first, so that placing one never closes another still to be placed
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, max(targets) + 1) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(high, targets):
        os.dup2(fd, target)
        os.close(fd)
    _join_network_namespace(request["stand_in"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    if "-m" not in argv:  # `-c PROGRAM`: a process multiprocessing spawned (rank_python.py's rule too)
        _run_program(argv, request["parent"])  # exits
    module = argv.index("-m")
    assert argv[module + 1] == "cputrain", argv
    _become_cputrain(argv[module + 2:], unbuffered="-u" in argv[:module])


def serve_ranks(path: str) -> None:
    import select
    import signal
    import socket

    # A rank's end wakes select() through this pipe (select itself resumes after a signal).
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    ranks: dict[socket.socket, tuple[int, Path]] = {}  # the stand-in's connection -> its rank's pid, record
    Path(f"{path}.ranks").mkdir()
    while True:
        ready = select.select([listener, sys.stdin, wake_r, *ranks], [], [], 5.0)[0]
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return  # the test process is gone: so is every rank it started (their connections close)
        if wake_r in ready:
            os.read(wake_r, 4096)
        for conn in ready:
            if conn is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 64)
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    for fd in (wake_r, wake_w, listener.fileno(), conn.fileno(), *(c.fileno() for c in ranks)):
                        os.close(fd)
                    _rank(json.loads(message), fds)
                for fd in fds:
                    os.close(fd)
                try:
                    conn.sendall(json.dumps({"pid": pid}).encode())
                except OSError:  # its stand-in is gone already (killed as it started): so is its process
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    conn.close()
                    continue
                # Which process stands in for which rank, for the tests that kill ranks by name.
                record = Path(f"{path}.ranks", str(json.loads(message)["stand_in"]))
                record.write_text(str(pid))
                ranks[conn] = pid, record
            elif conn in ranks and not conn.recv(1):  # its stand-in was killed: kill the rank as well
                with contextlib.suppress(ProcessLookupError):
                    os.kill(ranks[conn][0], signal.SIGKILL)
        while True:  # answer for every rank that has ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            for conn, (rank_pid, record) in list(ranks.items()):
                if rank_pid == pid:
                    record.unlink()
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                    conn.close()
                    del ranks[conn]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ranks"]:
        serve_ranks(sys.argv[2])
    else:
        main()
