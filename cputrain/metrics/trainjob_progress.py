"""A Kubeflow TrainJob's progress: rank 0 POSTs it to the Trainer controller's status endpoint.

The Trainer controller (v2.2+, feature gate TrainJobStatus) gives every trainer container
KUBEFLOW_TRAINER_SERVER_URL (https://…/apis/trainer.kubeflow.org/v1alpha1/namespaces/NS/
trainjobs/NAME/status), KUBEFLOW_TRAINER_SERVER_CA_CERT (the file of the CA that signed the
endpoint's certificate) and KUBEFLOW_TRAINER_SERVER_TOKEN (the file of a projected
service-account token whose audience names this TrainJob). The body is the TrainJob's own
`status.trainerStatus`: progressPercentage (0-100), estimatedRemainingSeconds, metrics as
name/value strings, lastUpdatedTime. Where the URL is not set nothing here runs; like
transformers' KubeflowCallback, DISABLE_KUBEFLOW_INTEGRATION=true turns it off.

Reporting must never cost training anything: the training thread only reads a clock and, at
most every `every_s`, hands a small body to one background thread, which keeps the newest body
only and POSTs with a short timeout. A failing endpoint is one warning, then silence.
"""

from __future__ import annotations

import json
import logging
import math
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

log = logging.getLogger("cputrain")

ENV_URL = "KUBEFLOW_TRAINER_SERVER_URL"
ENV_CA_CERT = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
ENV_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"
ENV_DISABLE = "DISABLE_KUBEFLOW_INTEGRATION"  # transformers' switch; the same meaning here

POST_TIMEOUT_S = 5.0
# metrics.jsonl's names, the last known value of each (val_loss lives between validations).
METRIC_KEYS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "trained_tokens_per_s", "mfu", "epoch",
               "rewards/accuracies", "rewards/margins")
FIELD_MAX_CHARS = 64  # the CRD's limit on a metric's name and on its value
INT32_MAX = 2**31 - 1  # progressPercentage and estimatedRemainingSeconds are int32


def from_env(environ: Mapping[str, str], every_s: float, total_steps: int) -> TrainJobProgress | None:
    """The reporter where the Trainer controller set the endpoint, else None."""
    url = environ.get(ENV_URL, "").strip()
    if not url or environ.get(ENV_DISABLE, "").strip().lower() in ("true", "1", "yes"):
        return None
    return TrainJobProgress(url, environ.get(ENV_TOKEN) or None, environ.get(ENV_CA_CERT) or None, every_s,
                            total_steps)


def _value(v) -> str | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return str(v) if isinstance(v, int) else f"{v:.6g}"


class TrainJobProgress:
    def __init__(self, url: str, token_file: str | None, ca_file: str | None, every_s: float, total_steps: int,
                 timeout_s: float = POST_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        self.url, self.token_file, self.ca_file = url, token_file, ca_file
        self.every_s, self.total_steps, self.timeout_s, self.clock = every_s, max(1, total_steps), timeout_s, clock
        self.posted = self.failed = 0  # POSTs that got a 2xx / that did not
        self._warned = self._recovery_said = False
        self._metrics: dict[str, str] = {}
        self._first: tuple[int, float] | None = None  # (step, time) at the end of this session's first step
        self._last_submit_s = -math.inf
        self._next_post_s = -math.inf  # the worker's own floor: POSTs start every_s apart
        self._slot: bytes | None = None  # the newest body not yet sent; older ones are dropped
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="trainjob-progress", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the training thread
    def start(self, step: int) -> None:
        """Before the session's first step: where it starts (a resumed run is not at 0%)."""
        self._submit(self._body(step))

    def step(self, step: int, row: dict | None) -> None:
        """After every step; `row` is the step's metrics.jsonl row, None between logged steps."""
        now = self.clock()
        if self._first is None:
            # The first step holds warm-up (allocation, compile): the remaining time is timed from its end.
            self._first = (step, now)
        for key in METRIC_KEYS:
            value = _value(row.get(key)) if row else None
            if value is not None:
                self._metrics[key] = value
        if now - self._last_submit_s >= self.every_s:
            self._submit(self._body(step, self._remaining_s(step, now)))

    def end(self, step: int, status: str) -> None:
        """The session's last word: 100% when the run finished its last step, else where it
        ended and why (the metric `status`; a session ended by train.stop_at_step is `finished`
        short of 100); waits for that POST at most the timeout, then the reporter is closed."""
        self._metrics["status"] = status
        complete = status == "finished" and step >= self.total_steps
        self._submit(self._body(step, 0 if complete else None, complete=complete))
        self.close()

    def close(self) -> None:
        """Sends what is pending (at most one body), waiting no longer than one POST's timeout."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(self.timeout_s + 1.0)

    # ------------------------------------------------------------------ the body
    def _remaining_s(self, step: int, now: float) -> int | None:
        """Seconds left at this session's measured pace (evaluations and saves included, as they
        will be in the time left); unknown until a second step has ended. The pace is this
        session's alone: a resumed run's earlier steps were timed by another process."""
        first_step, first_s = self._first
        if step <= first_step:
            return None
        per_step_s = (now - first_s) / (step - first_step)
        return min(INT32_MAX, max(0, round(per_step_s * (self.total_steps - step))))

    def _body(self, step: int, remaining_s: int | None = None, complete: bool = False) -> bytes:
        # Below 100% until the run is complete: 100 says the job is done (transformers does the same).
        percent = 100 if complete else min(99, max(0, 100 * step // self.total_steps))
        metrics = {**self._metrics, "current_step": str(step), "total_steps": str(self.total_steps)}
        status = {
            "progressPercentage": percent,
            "metrics": [{"name": k[:FIELD_MAX_CHARS], "value": v[:FIELD_MAX_CHARS]} for k, v in metrics.items()],
            "lastUpdatedTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        if remaining_s is not None:  # absent: unknown (the API's own meaning)
            status["estimatedRemainingSeconds"] = remaining_s
        return json.dumps({"trainerStatus": status}).encode()

    def _submit(self, body: bytes) -> None:
        self._last_submit_s = self.clock()
        with self._cond:
            self._slot = body
            self._cond.notify()

    # ------------------------------------------------------------------ the background thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while self._slot is None and not self._closing:
                    self._cond.wait()
                # A body handed over while a slow POST was out waits for its turn; the last one, at
                # close, does not.
                while not self._closing and self.clock() < self._next_post_s:
                    self._cond.wait(self._next_post_s - self.clock())
                body, self._slot = self._slot, None
                if body is None:
                    return
            self._next_post_s = self.clock() + self.every_s
            self._post(body)

    def _post(self, body: bytes) -> None:
        try:
            headers = {"Content-Type": "application/json"}
            if self.token_file:
                # Read every time: the kubelet rewrites a projected token before it expires (1 h).
                with open(self.token_file, encoding="utf-8") as f:
                    headers["Authorization"] = f"Bearer {f.read().strip()}"
            # The CA file too: the controller's certificates rotate, and a context is cheap next to 5 s.
            context = ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=context) as response:
                response.read()
        except Exception as exc:  # whatever goes wrong here (a bad URL, TLS, a dead endpoint), training must not see it
            self.failed += 1
            if not self._warned:
                self._warned = True
                log.warning("TrainJob progress: POST to %s failed (%s); training goes on, and further failures "
                            "are not logged", self.url, _reason(exc))
            return
        self.posted += 1
        if self._warned and not self._recovery_said:
            self._recovery_said = True
            log.info("TrainJob progress: POST to %s works again (%d failed before)", self.url, self.failed)


def _reason(exc: Exception) -> str:
    """One line: the HTTP status and the controller's message (a metav1.Status), or the error."""
    if isinstance(exc, urllib.error.HTTPError):
        try:
            message = json.loads(exc.read() or b"{}").get("message", "")
        except (ValueError, AttributeError, OSError):
            message = ""
        return f"HTTP {exc.code}" + (f": {message}" if message else "")
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return f"{type(exc).__name__}: {exc}"
