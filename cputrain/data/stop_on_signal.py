"""Data preparation stops at once on SIGTERM or Ctrl-C, keeps what reached the disk, and leaves no process behind.

A training step is worth finishing (a checkpoint follows it); a tokenizing pass is not: its
progress is committed every 2 s, so a signal raises PreparationStopped wherever the main
thread is. The builder then commits what it wrote, terminates its tokenizing pool and releases
the locks it took (cache_lock's `finally`); the process that started it waits for that, releases
the lock it held for the builder (cputrain.data.prepare), then says its one line (exit code 75,
as a stopped run: re-run the same command to resume).

The processes of a preparation (builder, tokenizing workers) also die with their parent
(Linux's PR_SET_PDEATHSIG): a command killed outright (a second signal, the OOM killer, SIGKILL)
takes them with it instead of leaving them tokenizing on, holding memory and the caller's pipes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

from cputrain.errors import Stopped

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class PreparationStopped(Stopped):
    """A signal reached a process while it prepared data."""

    def __init__(self, signal_name: str, message: str = ""):
        self.signal_name = signal_name
        super().__init__(message or f"stopped by {signal_name} while preparing the data")

    def __reduce__(self):  # sent from the builder process to the one that started it
        return PreparationStopped, (self.signal_name, str(self))


@contextlib.contextmanager
def stop_on_signal(ignore_after_first: bool = False):
    """Within the block, SIGTERM and SIGINT raise PreparationStopped in the main thread.

    After the first signal the previous handlers are back (a second Ctrl-C acts at once), or,
    with `ignore_after_first` (a builder process, whose parent forwards the signal it got and
    may be reached by a terminal's Ctrl-C as well), further ones are ignored while it cleans up.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if ignore_after_first else handler)

    def on_signal(signum, frame) -> None:
        restore()
        raise PreparationStopped(signal.Signals(signum).name)

    for sig in SIGNALS:
        signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when `parent_pid`, which started it, ends (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent ended while this process was starting
        os._exit(1)


def start_tokenizing_worker(parent_pid: int, init, *init_args) -> None:
    """A tokenizing pool process: dies with the builder, and leaves Ctrl-C (which a terminal sends
    to every process of the group) to the builder, which terminates the pool."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init(*init_args)
