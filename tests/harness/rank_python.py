"""The `python` a torchrun agent runs for each rank in the tests (torchrun's PYTHON_EXEC): it asks
the rank server (tests/harness/warm_interpreter.py --ranks), which has torch and transformers imported, to
fork the rank, hands it this process's stdin/stdout/stderr, forwards the agent's signals to it and
ends as it ends (its exit code, or the signal that killed it). The agent sees one process per rank
that behaves as `python -u -m cputrain train ...` does, without ~4 s of imports per rank.

It is also the `python` multiprocessing spawns with in a forked command (warm_interpreter.py sets
it where the command was started to be waited for): `python -c PROGRAM --multiprocessing-fork`,
with the pipes multiprocessing passed it open at their numbers. It hands those on as well (and
closes its own copies, so the parent sees the pipes close when the child ends), and the server's
child runs the program: the data preparation's builder and its tokenizing workers start without
~4 s of imports each.

Runs with `python -S` (the standard library only). Where the server cannot serve the rank as
asked (no server, or a preloaded allocator that a fork cannot take), it becomes the real python.
"""

import json
import os
import signal
import socket
import sys


def _real_python() -> None:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


def _open_fds(but: int) -> list[int]:
    """stdin, stdout, stderr, then every other descriptor open here (those a spawning parent passed)."""
    numbers = sorted(int(name) for name in os.listdir("/proc/self/fd"))
    found = []
    for fd in numbers:
        try:
            os.fstat(fd)  # the listing's own descriptor is closed by now
        except OSError:
            continue
        if fd != but and fd > 2:
            found.append(fd)
    return [0, 1, 2, *found]


def _die_with_parent() -> None:
    """SIGKILL from the kernel when the parent ends (prctl PR_SET_PDEATHSIG; Linux)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def main() -> None:
    server = os.environ.get("CPUTRAIN_TEST_RANK_SERVER")
    if not server or os.environ.get("LD_PRELOAD"):
        _real_python()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(server)
    except OSError:
        _real_python()
    if "-m" not in sys.argv[1:]:  # `-c PROGRAM`: a process multiprocessing spawned (the server's rule too);
        # it ends with its parent, as one that asks (the data builder) does
        _die_with_parent()
    fds = _open_fds(conn.fileno())
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ), "stand_in": os.getpid(),
               "parent": os.getppid(), "fds": fds}
    socket.send_fds(conn, [json.dumps(request).encode()], fds)
    for fd in fds[3:]:  # the child holds them now: a pipe's end kept here would outlive it
        os.close(fd)
    rank = json.loads(conn.recv(4096))["pid"]
    def forward(received, _frame):
        try:
            os.kill(rank, received)
        except ProcessLookupError:  # it has just ended: its exit code is on its way
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    answer = conn.recv(4096)
    code = json.loads(answer)["returncode"] if answer else 1
    if code < 0:  # killed by a signal: end by the same one
        if -code != signal.SIGKILL:  # its action cannot be set (signal.signal raises): it is the default
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
