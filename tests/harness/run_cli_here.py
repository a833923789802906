"""A `cputrain` command's entry function in the test's own process: for what is refused before any
work, without a new interpreter (~5 s each)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import warnings

from harness.cli_env import LAUNCHER_VARIABLES


class _ReachedWork(AssertionError):
    pass


def _no_work(*_args, **_kwargs):
    raise _ReachedWork("the command was not refused before work: it reached the worker or the agent "
                       "(test it with run_cli, in its own process)")


@contextlib.contextmanager
def _process_state(env: dict | None, cwd):
    """os.environ, the working folder, the logging set-up, the cores and torch's threads as they
    were, after the call (a worker run here pins this process to its rank's cores)."""
    import torch

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_cpus, saved_threads = os.sched_getaffinity(0), torch.get_num_threads()
    loggers = {name: (lg.handlers[:], lg.level, lg.propagate)
               for name in ("cputrain", "py.warnings") for lg in [logging.getLogger(name)]}
    saved_format, capturing = warnings.formatwarning, logging._warnings_showwarning is not None
    for key in LAUNCHER_VARIABLES:
        os.environ.pop(key, None)
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    if cwd is not None:
        os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.sched_setaffinity(0, saved_cpus)
        torch.set_num_threads(saved_threads)
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
