"""Communication you can see: time in collectives and bytes each rank sent and received.

The meter wraps the torch.distributed collectives that DDP (through its comm hook) and FSDP2
(all_gather_single / reduce_scatter_single) call. For each call it records the payload and
the interval from issue to completion (the Work's future, for async calls), and turns the
payload into bytes on the wire with the collective's ring cost, which is what gloo and oneCCL
run for these sizes: an all-reduce of N bytes sends and receives 2·(W−1)/W·N per rank, an
all-gather, reduce-scatter or all-to-all over N bytes (W−1)/W·N (gloo's reduce-scatter is an
all-reduce: 2·(W−1)/W·N). tests/distributed check the totals against /proc/net/dev of a
private loopback.

`comm_time_s` is the wall time during which at least one collective was in flight. Under
DDP the all-reduce of one bucket overlaps the backward pass of the next, so this is an upper
bound of the time communication cost the step, and exactly it when nothing overlaps.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.distributed as dist

# name -> (which argument holds the payload, wire bytes per payload byte for world size W)
_RING = {
    "all_reduce": ("tensor", lambda w: 2 * (w - 1) / w),
    "all_gather_single": ("output_tensor", lambda w: (w - 1) / w),
    "all_gather_into_tensor": ("output_tensor", lambda w: (w - 1) / w),
    "reduce_scatter_single": ("input", lambda w: (w - 1) / w),
    "reduce_scatter_tensor": ("input", lambda w: (w - 1) / w),
    "broadcast": ("tensor", lambda w: (w - 1) / w),  # pipelined broadcast: each rank forwards once
    "all_to_all_single": ("input", lambda w: (w - 1) / w),  # every slice but its own, once
}
# gloo has no reduce-scatter of its own: it all-reduces the whole tensor and keeps a slice, sending
# what an all-reduce sends (measured on a private loopback, tests/distributed/test_comm_bytes.py).
_GLOO_AS_ALL_REDUCE = ("reduce_scatter_single", "reduce_scatter_tensor")


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


class CommMeter:
    """Installed once per process; `window()` returns and resets the figures since the last call."""

    _active: CommMeter | None = None

    def __init__(self):
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._open = 0  # collectives issued but not yet complete
        self._sent = self._recv = 0
        self._calls = 0
        self._window_t0 = time.perf_counter()
        self._originals: dict[str, object] = {}
        self._suspended = False
        self._suspended_s = 0.0  # time in checkpoint saves/loads this window: not training-step time
        self.total = {"comm_time_s": 0.0, "comm_sent_bytes": 0, "comm_recv_bytes": 0, "comm_calls": 0}

    # --- installation -------------------------------------------------------------------
    @classmethod
    def install(cls) -> CommMeter:
        if cls._active is None:
            meter = cls()
            for name in _RING:
                original = getattr(dist, name)
                meter._originals[name] = original
                setattr(dist, name, meter._wrap(name, original))
            cls._active = meter
        return cls._active

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        if CommMeter._active is self:
            CommMeter._active = None

    def _wrap(self, name, original):
        arg, factor = _RING[name]
        import inspect

        position = list(inspect.signature(original).parameters).index(arg)

        def metered(*args, **kwargs):
            if self._suspended:
                return original(*args, **kwargs)
            payload = args[position] if len(args) > position else kwargs.get(arg)
            group = kwargs.get("group")
            world = dist.get_world_size(group) if dist.is_initialized() else 1
            cost = factor
            if name in _GLOO_AS_ALL_REDUCE and dist.is_initialized() and dist.get_backend(group) == "gloo":
                cost = _RING["all_reduce"][1]
            wire = int(_nbytes(payload) * cost(world)) if world > 1 else 0
            t0 = time.perf_counter()
            with self._lock:
                self._open += 1
            work = original(*args, **kwargs)
            if work is None:  # synchronous: complete on return
                self._done(t0, wire)
            else:
                fut = work.get_future()
                fut.add_done_callback(lambda _f: self._done(t0, wire))
            return work

        metered.__wrapped__ = original
        return metered

    def _done(self, t0: float, wire: int) -> None:
        t1 = time.perf_counter()
        with self._lock:
            self._open -= 1
            self._intervals.append((t0, t1))
            self._sent += wire
            self._recv += wire  # ring collectives are symmetric: what a rank sends, it also receives
            self._calls += 1

    @contextlib.contextmanager
    def suspended(self):
        """Leave checkpoint traffic (DCP's plan exchange, gathers for export) out of the step figures."""
        t0 = time.perf_counter()
        self._suspended = True
        try:
            yield
        finally:
            self._suspended = False
            with self._lock:
                self._suspended_s += time.perf_counter() - t0

    # --- reading ------------------------------------------------------------------------
    def window(self) -> dict:
        """Figures since the previous call: comm_time_s, comm_fraction, comm_sent_bytes, comm_recv_bytes."""
        now = time.perf_counter()
        with self._lock:
            intervals, self._intervals = sorted(self._intervals), []
            sent, recv, calls = self._sent, self._recv, self._calls
            self._sent = self._recv = self._calls = 0
            t0, self._window_t0 = self._window_t0, now
            suspended_s, self._suspended_s = self._suspended_s, 0.0
        busy, end = 0.0, t0
        for a, b in intervals:  # union of the in-flight intervals
            a = max(a, end)
            if b > a:
                busy += b - a
                end = b
        wall = max(now - t0 - suspended_s, 1e-9)
        for key, value in (("comm_time_s", busy), ("comm_sent_bytes", sent), ("comm_recv_bytes", recv),
                           ("comm_calls", calls)):
            self.total[key] += value
        window = {"comm_time_s": busy, "comm_fraction": min(1.0, busy / wall), "comm_sent_bytes": sent,
                  "comm_recv_bytes": recv}
        window.update(_per_rank(busy, sent, recv))
        return window


class _NoMeter:
    """The meter of a strategy that meters nothing (single, zero3): no figures, nothing to suspend."""

    def window(self) -> dict:
        return {}

    def suspended(self):
        return contextlib.nullcontext()

    def uninstall(self) -> None:
        pass


NO_METER = _NoMeter()


def _per_rank(busy_s: float, sent: int, recv: int) -> dict:
    """Every rank's figures of this window, in rank order (metrics.jsonl is written by rank 0,
    whose own figures are the fields above). Every rank logs at the same steps, so all call this
    together; the list form of all_gather is not metered, and its few bytes are not step traffic."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    mine = torch.tensor([busy_s, float(sent), float(recv)], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {"comm_time_s_per_rank": [float(t[0]) for t in every],
            "comm_sent_bytes_per_rank": [int(t[1]) for t in every],
            "comm_recv_bytes_per_rank": [int(t[2]) for t in every]}


def summarize(rows: list[dict]) -> dict:
    """summary.json figures from the logged rows: fraction of step time, bytes per step."""
    rows = [r for r in rows if "comm_time_s" in r and "step_time_s" in r]
    if not rows:
        return {}
    # Steps each row covers (rows are logged every log_every steps); the first row's gap is
    # taken from the next one.
    gaps = [b["step"] - a["step"] for a, b in zip(rows, rows[1:])]
    steps = [gaps[0] if gaps else 1] + gaps
    step_time = sum(r["step_time_s"] * n for r, n in zip(rows, steps))
    comm_time = sum(r["comm_time_s"] for r in rows)
    n_steps = sum(steps)
    return {
        "comm_fraction": min(1.0, comm_time / step_time) if step_time else 0.0,
        "comm_time_per_step_s": comm_time / n_steps,
        "comm_sent_bytes_per_step": sum(r["comm_sent_bytes"] for r in rows) / n_steps,
        "comm_recv_bytes_per_step": sum(r["comm_recv_bytes"] for r in rows) / n_steps,
    }
