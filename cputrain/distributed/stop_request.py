"""A request to stop at the next step boundary: SIGTERM (what Kubernetes sends a pod before it
kills it, e.g. when a spot node is reclaimed) or a first Ctrl-C.

The handler only sets a flag; the training loop reads it once per step, all ranks agree on it in
the step's one small all-reduce (so a signal that reached one node stops every rank at the same
step), and the run then saves a checkpoint and ends with errors.Stopped (exit code 75). After the first
signal the default handlers are back: a second Ctrl-C interrupts at once, a second SIGTERM kills.
Neither can damage a checkpoint: a step folder becomes complete only by a rename.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("cputrain")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self):
        self.signal_name: str | None = None  # the first signal received, e.g. "SIGTERM"
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> StopRequest:
        """Handle SIGTERM and SIGINT in this process (signals reach the main thread only)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        log.warning("%s received: finishing this step, then saving a checkpoint (a second signal stops at once)",
                    self.signal_name)
        self.uninstall()  # the second signal does what it always does
