"""`python -m cputrain ARGS` without paying for the imports each time: a warm interpreter forks.

Each `cputrain` command a test starts is a fresh interpreter that spends ~4 s of CPU importing
torch and transformers before it reads its arguments (a tiny training run then takes ~1 s). This
server imports those libraries once, runs no torch operation (so no OpenMP pool or other thread
state is copied into a child), then for each request forks a child that becomes
`python -m cputrain ARGS`: its own pid, working folder, stdout and stderr files, exit code and
signals, and cputrain itself imported fresh in the child (the server never imports it). What it
cannot give is a different environment at import time, so a run_cli call with its own `env`, and
a test that measures a process's memory, start a fresh interpreter instead (conftest.run_cli).

Protocol, one JSON object per line: the request {"argv", "cwd", "stdout", "stderr"} (the two
output paths are files the child writes); the answers {"pid"} at once and {"returncode"} when the
child has ended (negative: the signal that ended it, as subprocess reports it).
"""

from __future__ import annotations

import json
import os
import sys

# What every cputrain command that trains, evaluates or samples imports first: the bulk of its
# start-up. cputrain's own modules are not imported here, so no state of theirs is inherited.
import numpy  # noqa: F401
import safetensors.torch  # noqa: F401
import tokenizers  # noqa: F401
import torch.distributed  # noqa: F401 (binds torch too)
import transformers  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401


def _child(request: dict) -> None:
    """Become `python -m cputrain ARGV` and exit with its code."""
    import atexit
    import runpy

    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    code = 0
    try:
        sys.argv = ["-m", *request["argv"]]  # run_module puts the module's path first, as `python -m` does
        runpy.run_module("cputrain", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (any uncaught exception: the traceback and exit 1, as the interpreter does)
        import traceback

        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what an interpreter runs at exit (multiprocessing joins its children)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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


if __name__ == "__main__":
    main()
