"""The profile of one step (train.profile_step): a real profiler run of a small workload, split into
operator families whose shares sum to the step, matmul FLOPs and rate, the recompute told apart."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from cputrain.metrics.step_profile import OPTIMIZER_REGION, StepProfile, recording, summarize
from cputrain.run_folder.layout import RunFolder

N = 128  # small: the products take microseconds; the profiler's first start is most of the time


def _block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) @ w


def test_families_split_the_step_and_the_matmuls_have_their_flops_and_rate():
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(N, N, generator=gen), torch.randn(N, N, generator=gen, requires_grad=True)
    with recording() as profiler:
        loss = (_block(a, w) * 2 + 1).sum()
        loss.backward()
        with torch.profiler.record_function(OPTIMIZER_REGION), torch.no_grad():
            w.add_(w.grad, alpha=-1e-3)
    summary = summarize(profiler)
    families = summary["families"]
    assert summary["step_s"] > 0
    assert sum(f["share"] for f in families.values()) == pytest.approx(1.0, abs=1e-6)
    assert families["matmul"]["share"] > 0 and families["elementwise"]["share"] > 0
    assert families["optimizer"]["share"] > 0 and families["recompute"]["share"] == 0
    matmuls = summary["matmul_kernels"]
    # forward: 2 products; backward: w's gradient through both (2) and the input's of the second (1)
    assert matmuls["flops"] == 5 * 2 * N**3 and matmuls["gflop_per_s"] > 0
    top = {op["name"]: op["calls"] for op in summary["top_operators"]}
    assert len(summary["top_operators"]) == 10 and top.get("aten::mm") == 5


def test_the_recompute_of_checkpointed_blocks_is_its_own_family():
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(N, N, generator=gen), torch.randn(N, N, generator=gen, requires_grad=True)
    with recording() as profiler:
        checkpoint(_block, a, w, use_reentrant=False).sum().backward()
    whole = summarize(profiler)
    assert whole["families"]["recompute"]["share"] > 0
    # The recompute runs the first product again and stops (torch's early stop) inside the second,
    # before its kernel, once the tensors the backward needs are back: one product run, not two.
    product = 2 * N**3
    assert whole["matmul_kernels"]["recompute_flops"] == product
    assert whole["matmul_kernels"]["flops"] == (2 + 3 + 1) * product  # forward, backward, recompute

    # Selective checkpointing keeps the products: the first is returned from what was kept.
    def keep_matmuls(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def contexts():
        return create_selective_checkpoint_contexts(keep_matmuls)

    with recording() as profiler:
        checkpoint(_block, a, w, use_reentrant=False, context_fn=contexts).sum().backward()
    selective = summarize(profiler)
    assert selective["matmul_kernels"]["recompute_flops"] == 0
    assert selective["matmul_kernels"]["flops"] == (2 + 3) * product


def test_the_files_and_the_log_line(tmp_path):
    profile = StepProfile(RunFolder(str(tmp_path)), step=3)
    with profile.recording():
        torch.mm(torch.ones(N, N), torch.ones(N, N)).relu_()
    line = profile.write()
    summary = json.loads((tmp_path / "profile_step3.json").read_text())
    assert summary["step"] == 3 and summary["trace"] == "profile_step3.trace.json.gz"
    assert (tmp_path / "profile_step3.trace.json.gz").read_bytes()[:2] == b"\x1f\x8b"  # gzip
    assert line.startswith("profile of step 3 (") and "matmuls " in line and "GFLOP/s" in line
    assert line.endswith(f"written to {tmp_path}/profile_step3.json") and "\n" not in line
    assert profile.outside_step_s > 0 and profile.write_s > 0


class _FreedName:
    """A raw profiler event of Python code freed during the step: its name no longer reads."""

    def __init__(self, raw):
        self._raw = raw

    def name(self):
        raise UnicodeDecodeError("utf-8", b"\xcb", 0, 1, "invalid continuation byte")

    def __getattr__(self, attr):
        return getattr(self._raw, attr)


def test_python_code_freed_inside_the_step_costs_its_name_only():
    """torch.profiler keeps pointers into the code objects it saw (pytorch#136040): code run and
    dropped inside the step (a module imported there, code exec'd or compiled there) may no longer
    be named, and torch's own events() then fails on the whole profile. Not reproducible at will
    (it takes the freed memory to be reused), hence the stand-in."""
    with recording() as profiler:
        torch.mm(torch.ones(N, N), torch.ones(N, N)).relu_()
    raw = profiler.profiler.kineto_results.events()
    freed = [_FreedName(e) if e.is_python_function() else e for e in raw]
    holder = types.SimpleNamespace(profiler=types.SimpleNamespace(kineto_results=types.SimpleNamespace(
        events=lambda: freed)))
    summary = summarize(holder)
    assert summary["matmul_kernels"]["flops"] == 2 * N**3
    assert sum(f["share"] for f in summary["families"].values()) == pytest.approx(1.0, abs=1e-6)
