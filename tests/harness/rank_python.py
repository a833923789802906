"""The `python` a torchrun agent runs for each rank in the tests (torchrun's PYTHON_EXEC): it asks
the rank server (tests/harness/warm_interpreter.py --ranks), which has torch and transformers imported, to
fork the rank, hands it this process's stdin/stdout/stderr, forwards the agent's signals to it and
ends as it ends (its exit code, or the signal that killed it). The agent sees one process per rank
that behaves as `python -u -m cputrain train ...` does, without ~4 s of imports per rank.

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


def main() -> None:
    server = os.environ.get("CPUTRAIN_TEST_RANK_SERVER")
    if not server or os.environ.get("LD_PRELOAD"):
        _real_python()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(server)
    except OSError:
        _real_python()
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ), "stand_in": os.getpid()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
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
