"""The profile of one optimizer step (train.profile_step): where its time goes, by operator family.

Rank 0 runs the step under torch.profiler (CPU activity, record_shapes, with_flops, with_stack)
inside a `record_function` region of its own, then writes two files into the run folder:

    profile_step<N>.json            the summary below (a few KB)
    profile_step<N>.trace.json.gz   the whole step as a Chrome trace (chrome://tracing, ui.perfetto.dev):
                                    every operator and Python call; tens of MB before gzip at 8B

The summary: the step's wall seconds; per operator family, the self CPU seconds spent in it and
its share of the step (the families split the step's time between them, so the shares sum to 1);
the matrix products' FLOPs (the profiler's count for mm/addmm/bmm/baddbmm) and the rate their
kernels ran at; the 10 operators with the most self time, with their call counts.

Self time, not total: a `aten::linear` holds its `aten::addmm`, an autograd node its formula's
operators; each microsecond is counted once, at the innermost event that spent it. The events are
read raw and nested here by time, as torch nests them: torch's own events() and key_averages()
fail on the whole profile when one Python name no longer reads (see _name). The families are
decided, in this order, by where an event runs, then by its name:

- optimizer: everything inside the trainer's OPTIMIZER_REGION (clipping, AdamW, zeroing the gradients).
- recompute: everything inside torch.utils.checkpoint's `recompute_fn`, the block forward that
  activation checkpointing runs again in the backward. Without the Python frames (with_stack) the
  profiler shows these forward operators as children of whichever backward node first unpacked a
  saved tensor (e.g. `MmBackward0`), mixed with that node's own formula: not separable. With them,
  the `torch/utils/checkpoint.py(…): recompute_fn` frame encloses exactly the recomputation.
  Compiled blocks (model.compile) are the exception: the checkpoint is traced into the compiled
  graph, and the recompute runs inside its backward among the gradient's own operators, where
  nothing tells it apart; there its matmuls count as matmuls.
- compiled: inside a torch.compile'd graph (inductor's "## Call CompiledFxGraph" region), the time
  in no aten operator: its fused kernels (norms, activations, rotary) and their Python wrappers;
  the graph's matmuls and copies are aten operators, counted by name as anywhere else.
- python: time in no operator: Python and the framework between operators (the traced Python
  frames' self time, selective checkpointing's dispatch mode, the step region's own gaps).
- collectives: c10d/gloo calls (what rank 0 waits for the other ranks shows up here).
- matmul, attention (the fused SDPA kernels), cross_entropy (log-softmax, NLL, logsumexp, and the
  non-matmul work of cputrain's chunked head), casts_copies, elementwise (pointwise math and the
  reductions of norms), other (views, allocation, indexing, autograd bookkeeping).

The matmul rate counts every matmul kernel of the step, the recompute's included: it is the
kernels' speed, whoever called them. The profiler puts FLOPs on every matmul entered, run or not;
two kinds are entered and not run, and are not counted: under selective checkpointing every
operator is entered twice (once at the dispatch mode, once for real), and a kept matmul is
entered in the recompute only to return the product kept (the call with a `PythonDispatchMode`
child); and each recompute stops (torch's early stop) inside the last matmul it enters, before
its kernel: in a Llama block, down_proj's.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import os
import tempfile
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from cputrain.metrics import finite_json
from cputrain.run_folder.layout import RunFolder

STEP_REGION = "cputrain: profiled step"  # the record_function the whole step runs in
OPTIMIZER_REGION = "optimizer"  # the trainer's region around clipping, the optimizer step and zero_grad
SUMMARY_NAME = "profile_step{step}.json"
TRACE_NAME = "profile_step{step}.trace.json.gz"

# Family name → what it holds (the summary carries it, for whoever reads the file without this module).
FAMILIES = {
    "matmul": "matrix products (mm, addmm, bmm, linear and matmul wrappers)",
    "attention": "fused attention kernels (scaled_dot_product_*), forward and backward",
    "cross_entropy": "log-softmax, NLL, logsumexp; the chunked head's non-matmul work",
    "optimizer": "clipping, the optimizer step and zero_grad (the trainer's optimizer region)",
    "recompute": "activation checkpointing's forward run again in the backward, its matmuls included",
    "casts_copies": "dtype casts and copies (to, _to_copy, copy_, clone, contiguous)",
    "elementwise": "pointwise math and the reductions of norms and softmax",
    "compiled": "torch.compile'd code outside aten operators: inductor's fused kernels and their Python wrappers",
    "collectives": "c10d/gloo collectives, waiting for the other ranks included",
    "other": "other operators: views, allocation, indexing, autograd bookkeeping",
    "python": "no operator: Python and the framework between operators",
}

MATMUL_KERNELS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_addmm_activation"}
MATMUL_WRAPPERS = {"aten::linear", "aten::matmul", "aten::einsum", "aten::bilinear"}
ATTENTION_PREFIXES = ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_flash_attention",
                      "aten::_efficient_attention")
CROSS_ENTROPY = {"aten::cross_entropy_loss", "aten::log_softmax", "aten::_log_softmax",
                 "aten::_log_softmax_backward_data", "aten::nll_loss", "aten::nll_loss_nd", "aten::nll_loss_forward",
                 "aten::nll_loss_backward", "aten::nll_loss2d_forward", "aten::nll_loss2d_backward", "aten::logsumexp"}
# cputrain's chunked head (kernels/chunked_loss.py, chunked_logps.py): the profiler names a custom
# autograd Function's forward and backward after its class; their softmax work is the loss's.
LOSS_FUNCTIONS = ("_ChunkedLinearCrossEntropy", "_ChunkedTokenLogps")
CASTS_COPIES = {"aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous", "aten::_copy_from",
                "aten::_copy_from_and_resize", "aten::type_as"}
ELEMENTWISE = {  # without the aten:: prefix and any trailing _ (in-place forms)
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "reciprocal", "exp", "log", "abs", "sign",
    "silu", "silu_backward", "gelu", "gelu_backward", "sigmoid", "sigmoid_backward", "tanh", "tanh_backward",
    "relu", "threshold_backward", "softmax", "_softmax", "_softmax_backward_data", "sin", "cos", "clamp",
    "clamp_min", "clamp_max", "maximum", "minimum", "where", "masked_fill", "fill", "zero", "lerp", "addcmul",
    "addcdiv", "mean", "sum", "amax", "amin", "max", "min", "eq", "ne", "lt", "le", "gt", "ge",
    "rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward", "native_layer_norm", "native_layer_norm_backward",
    "dropout", "native_dropout", "native_dropout_backward", "bernoulli", "_fused_dropout", "square",
}
DISPATCH_MODE = "PythonDispatchMode"  # selective checkpointing's mode, entered around every operator
# inductor's region around a compiled graph's call: its fused kernels run there outside any operator
COMPILED_GRAPH = "## Call CompiledFxGraph"


@contextlib.contextmanager
def recording():
    """Profile what runs inside, in STEP_REGION; yields the profiler, for summarize() once the block
    has ended. with_stack (the Python frames) is what tells the recompute apart."""
    # torch imports a module on the first record_function of a process; entered once before the
    # profiler starts, that import (and its code, which the profiler could no longer name: see
    # _name) stays out of the step.
    with record_function(STEP_REGION):
        pass
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True, with_stack=True) as prof:
        with record_function(STEP_REGION):
            yield prof


class _Event:
    """One event of the step's thread, with the events directly inside it."""

    __slots__ = ("name", "start_ns", "end_ns", "python", "annotation", "flops", "children", "parent")

    def __init__(self, raw):
        self.name = _name(raw)
        self.start_ns, self.end_ns = raw.start_ns(), raw.end_ns()
        self.python, self.annotation = raw.is_python_function(), raw.is_user_annotation()
        self.flops = raw.flops()
        self.children: list[_Event] = []
        self.parent: _Event | None = None

    @property
    def self_ns(self) -> int:
        return self.end_ns - self.start_ns - sum(c.end_ns - c.start_ns for c in self.children)


def _name(raw) -> str:
    """The event's name. The profiler keeps the names of the Python code it saw as pointers into
    the code objects; code run and dropped inside the step (a module imported there, code exec'd
    or compiled there) leaves them dangling, and the name may no longer read (pytorch#136040):
    torch's own events() and key_averages() then fail on the whole profile. Here only that name is lost."""
    try:
        return raw.name()
    except UnicodeDecodeError:
        return UNREADABLE


UNREADABLE = "<Python code freed during the step>"


def _step_tree(profiler: torch.profiler.profile) -> _Event:
    """The STEP_REGION event with every event of its thread inside it, nested as torch nests them
    (by time: an event inside another's interval is its child), read from the raw events."""
    raw = [e for e in profiler.profiler.kineto_results.events() if not e.is_async() and e.device_type() == DeviceType.CPU]
    regions = [e for e in raw if e.is_user_annotation() and _name(e) == STEP_REGION]
    if not regions:
        raise ValueError(f"no '{STEP_REGION}' region among the profiled events")
    step_raw = regions[0]
    step, thread = _Event(step_raw), step_raw.start_thread_id()
    inside = [_Event(e) for e in raw if e is not step_raw and e.start_thread_id() == thread
              and step.start_ns <= e.start_ns() and e.end_ns() <= step.end_ns]
    # Outer first; at equal intervals a Python call before the operator it makes.
    inside.sort(key=lambda e: (e.start_ns, -e.end_ns, not e.python))
    open_events = [step]
    for event in inside:
        while len(open_events) > 1 and (event.start_ns >= open_events[-1].end_ns
                                        or event.end_ns > open_events[-1].end_ns):
            open_events.pop()
        open_events[-1].children.append(event)
        event.parent = open_events[-1]
        open_events.append(event)
    return step


def _region(event: _Event, region: str | None) -> str | None:
    """The region `event` opens, or the one it is in."""
    if region is not None:
        return region
    if event.name == OPTIMIZER_REGION and event.annotation:
        return "optimizer"
    if event.python and event.name.endswith("): recompute_fn") and "checkpoint" in event.name:
        return "recompute"
    if event.name in LOSS_FUNCTIONS or event.name.removesuffix("Backward") in LOSS_FUNCTIONS:
        return "loss"
    if event.annotation and event.name.startswith(COMPILED_GRAPH):
        return "compiled"
    return None


def _family(event: _Event, region: str | None) -> str:
    name = event.name
    if region in ("optimizer", "recompute"):
        return region
    if event.python or event.annotation or name == DISPATCH_MODE:
        return "compiled" if region == "compiled" else "python"
    if name.startswith(("c10d::", "gloo:", "record_param_comms")):
        return "collectives"
    if name in MATMUL_KERNELS or name in MATMUL_WRAPPERS:
        return "matmul"
    if name.startswith(ATTENTION_PREFIXES):
        return "attention"
    if name in CROSS_ENTROPY or region == "loss":
        return "cross_entropy"
    if name in CASTS_COPIES:
        return "casts_copies"
    if name.startswith("aten::") and name[len("aten::"):].rstrip("_") in ELEMENTWISE:
        return "elementwise"
    return "other"


def _is_matmul_kernel_run(event: _Event) -> bool:
    """A matmul kernel with its FLOPs on record, and not selective checkpointing's re-entry of it
    (which returns the product kept). A recompute's early-stopped matmul is the caller's to leave out."""
    return (event.name in MATMUL_KERNELS and event.flops > 0
            and not any(child.name == DISPATCH_MODE for child in event.children))


def _early_stopped_operator(recompute: _Event) -> _Event | None:
    """The operator at which this recompute stopped. torch stops a recompute (early stop, its
    default, which cputrain keeps) by raising in the saved-tensor hook of the last tensor the
    backward needs; a matmul saves its inputs before its kernel runs, so the matmul holding that
    hook was entered, with its FLOPs on record, and never computed."""
    last_hook = None
    pending = [recompute]
    while pending:
        event = pending.pop()
        if event.python and event.name.endswith("): pack_hook") and "checkpoint" in event.name and (
                last_hook is None or event.start_ns > last_hook.start_ns):
            last_hook = event
        pending.extend(event.children)
    operator = last_hook.parent if last_hook is not None else None
    while operator is not None and (operator.python or operator.annotation):
        operator = operator.parent
    return operator


def summarize(profiler: torch.profiler.profile) -> dict:
    """The summary of the step a profiler recorded in STEP_REGION (see recording())."""
    step = _step_tree(profiler)
    step_ns = step.end_ns - step.start_ns
    family_ns: dict[str, int] = dict.fromkeys(FAMILIES, 0)
    op_ns: dict[str, int] = defaultdict(int)
    op_calls: dict[str, int] = defaultdict(int)
    matmul_flops = matmul_ns = recompute_flops = 0
    never_ran: set[int] = set()  # ids of the recomputes' early-stopped operators
    # Top-down from the step, carrying the region each event is in: one pass, however deep.
    pending = [(step, None)]
    while pending:
        event, region = pending.pop()
        opened = _region(event, region)
        if opened == "recompute" and region is None:
            stopped = _early_stopped_operator(event)
            if stopped is not None:
                never_ran.add(id(stopped))
        region = opened
        self_ns = event.self_ns
        family_ns[_family(event, region)] += self_ns
        if not (event.python or event.annotation or event.name == DISPATCH_MODE):
            op_ns[event.name] += self_ns
            op_calls[event.name] += 1
        if _is_matmul_kernel_run(event) and id(event) not in never_ran:
            matmul_flops += event.flops
            matmul_ns += self_ns
            if region == "recompute":
                recompute_flops += event.flops
        pending.extend((child, region) for child in event.children)
    top = sorted(op_ns, key=op_ns.get, reverse=True)[:10]
    return {
        "step_s": step_ns / 1e9,
        "families": {name: {"self_s": ns / 1e9, "share": ns / step_ns if step_ns else 0.0, "holds": FAMILIES[name]}
                     for name, ns in family_ns.items()},
        "matmul_kernels": {
            "flops": matmul_flops,
            "self_s": matmul_ns / 1e9,
            "gflop_per_s": matmul_flops / matmul_ns if matmul_ns else 0.0,  # FLOP per ns = GFLOP/s
            "recompute_flops": recompute_flops,
        },
        "top_operators": [{"name": name, "calls": op_calls[name], "self_s": op_ns[name] / 1e9,
                           "share": op_ns[name] / step_ns if step_ns else 0.0} for name in top],
    }


def write(run: RunFolder, step: int, profiler: torch.profiler.profile) -> tuple[dict, str]:
    """Summarise the recorded step, write its summary and its trace into the run folder; returns
    the summary and the summary file's path."""
    summary = {"step": step, **summarize(profiler),
               "profiled": "rank 0 only; torch.profiler with CPU activity, record_shapes, with_flops, with_stack",
               "trace": TRACE_NAME.format(step=step)}
    _write_trace(run, summary["trace"], profiler)
    name = SUMMARY_NAME.format(step=step)
    run.write_text(finite_json.dumps(summary, indent=2), name)
    return summary, run.path(name)


def _write_trace(run: RunFolder, name: str, profiler: torch.profiler.profile) -> None:
    """The Chrome trace, gzipped, into the run folder (local or an fsspec URL). The profiler writes
    a plain local file; it is streamed from there, any bytes of a name that no longer reads (see
    _name) replaced, so the file stays UTF-8."""
    with tempfile.TemporaryDirectory() as tmp:
        plain = os.path.join(tmp, "trace.json")
        profiler.export_chrome_trace(plain)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        run.fs.makedirs(run.root, exist_ok=True)
        with open(plain, "rb") as source, run.fs.open(run.path(name), "wb") as target, \
                gzip.GzipFile(fileobj=target, mode="wb", compresslevel=6) as packed:
            for chunk in iter(lambda: source.read(1 << 22), b""):
                packed.write(decoder.decode(chunk).encode())
            packed.write(decoder.decode(b"", final=True).encode())


LABELS = {"matmul": "matmuls", "cross_entropy": "cross-entropy", "casts_copies": "casts/copies",
          "compiled": "compiled kernels", "other": "other ops", "python": "outside operators"}


def log_line(summary: dict, where: str) -> str:
    """One line: every family of at least 0.5% of the step, largest first, the matmuls with their rate."""
    parts = []
    families = sorted(summary["families"].items(), key=lambda item: -item[1]["share"])
    for name, figures in families:
        if figures["share"] < 0.005:
            continue
        text = f"{LABELS.get(name, name)} {figures['share']:.0%}"
        if name == "matmul":
            text += f" ({summary['matmul_kernels']['gflop_per_s']:,.0f} GFLOP/s)"
        parts.append(text)
    return f"profile of step {summary['step']} ({summary['step_s']:.2f} s): {', '.join(parts)}; written to {where}"


class StepProfile:
    """Rank 0's profile of one step, for the trainer: record it, then write it, keeping count of
    the seconds spent outside the step (starting and stopping the profiler, writing the files),
    which the throughput window leaves out."""

    def __init__(self, run: RunFolder, step: int):
        self.run, self.step = run, step
        self.outside_step_s = 0.0  # starting and stopping the profiler, around the step
        self.write_s = 0.0
        self._profiler: torch.profiler.profile | None = None

    @contextlib.contextmanager
    def recording(self):
        started = time.perf_counter()
        with recording() as profiler:
            step_began = time.perf_counter()
            try:
                yield
            finally:
                step_s = time.perf_counter() - step_began
        self._profiler = profiler
        self.outside_step_s = time.perf_counter() - started - step_s

    def write(self) -> str:
        """Write the files; returns the log line."""
        started = time.perf_counter()
        try:
            summary, where = write(self.run, self.step, self._profiler)
        finally:
            self._profiler = None  # its events are large at 8B: let them go now
            self.write_s = time.perf_counter() - started
        return log_line(summary, where)
