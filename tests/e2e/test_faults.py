"""What a cluster does to a single-rank run: a SIGTERM mid-run (a spot node reclaimed), a loss that
diverges, a damaged checkpoint, a disk that fills during a save; and settings a resumed run must
honour. Each ends with one line and a documented exit code (docs/guides/faults-and-resume.md), and loses
no finished work."""

from __future__ import annotations

import json
import math
import signal
import time

import pytest
import torch

from harness.cli_env import cli_env
from harness.run_cli import run_cli
from harness.start_cli import start_cli
from harness.tiny_run import tiny_overrides

LONG = {"train.max_steps": 150, "train.checkpoint_every": 1000, "train.eval_every": 1000}


def _losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_sigterm_saves_a_checkpoint_at_the_reached_step_and_resume_equals_a_straight_run(tmp_path, cache_dir):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_cli("train", *tiny_overrides(straight, cache_dir, **LONG), check=True)

    with start_cli("train", *tiny_overrides(stopped, cache_dir, **LONG)) as proc:
        while proc.poll() is None:  # send the signal once a few steps are done
            if " step 5/" in proc.stderr():
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.01)
        proc.wait(timeout=120)
    stderr = proc.stderr()
    assert proc.returncode == 75, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    reached = max(_losses(stopped))
    assert 5 <= reached < 150, "the run ended before the signal: the test proved nothing"
    assert last == (f"cputrain: stopped by SIGTERM at step {reached}/150; checkpoint saved "
                    f"({stopped}/checkpoints/step-{reached:06d}); re-run the same command to resume"), last
    assert (stopped / "checkpoints" / f"step-{reached:06d}" / "trainer_state.json").is_file()
    ending = json.loads((stopped / "summary.json").read_text())  # a pipeline reads why it ended
    assert (ending["status"], ending["exit_code"], ending["final_step"]) == ("stopped", 75, reached)
    assert "cputrain: " + ending["reason"] == last
    assert not (stopped / "run.lock").exists()
    assert not (stopped / "model").exists()  # a stopped run is not a finished one

    resumed = run_cli("train", *tiny_overrides(stopped, cache_dir, **LONG), check=True)
    assert f"(step {reached})" in resumed.stderr
    a, b = _losses(straight), _losses(stopped)
    assert sorted(a) == sorted(b) == list(range(1, 151))
    assert all(a[s] == b[s] for s in a), [s for s in a if a[s] != b[s]][:5]


def test_a_diverging_loss_stops_with_one_line_and_keeps_the_finite_checkpoints(tmp_path, cache_dir):
    """lr=1e4 makes the loss non-finite within a few steps. Those steps are skipped (no weight sees
    them), max_bad_steps of them in a row stop the run with exit 3; every checkpoint left holds
    finite weights (keep_last=1 would have deleted the finite one for a NaN one before), and no
    model/ is exported."""
    out = tmp_path / "run"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{
        "train.lr": 1e4, "train.warmup_steps": 0, "train.grad_clip": 0, "train.max_steps": 40,
        "train.checkpoint_every": 1, "train.keep_last": 1, "train.max_bad_steps": 2}))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("cputrain: error: training diverged:") and "train.lr" in last, last
    ending = json.loads((out / "summary.json").read_text())
    assert (ending["status"], ending["exit_code"]) == ("diverged", 3) and "cputrain: error: " + ending["reason"] == last
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    bad = [s for s, r in rows.items()
           if any(r.get(k) is None or not math.isfinite(r[k]) for k in ("loss", "grad_norm"))]
    assert len(bad) >= 2, rows  # the run did diverge
    stop = max(rows)
    assert bad[-2:] == [stop - 1, stop]  # it stopped at the second bad step in a row
    assert not (out / "model").exists()
    # what a re-run may load (a save that no healthy step followed is set aside as step-N.diverged)
    checkpoints = sorted(p for p in (out / "checkpoints").iterdir() if "." not in p.name)
    assert checkpoints, "the finite checkpoint was deleted"
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for folder in checkpoints:
        flat = tmp_path / f"{folder.name}.pt"
        dcp_to_torch_save(str(folder / "state"), str(flat))
        state = torch.load(flat, weights_only=False)
        tensors = [t for t in _tensors(state)]
        assert tensors and all(torch.isfinite(t).all() for t in tensors), f"{folder.name} holds non-finite values"
    summary_line = [line for line in proc.stderr.splitlines() if "not finite" in line and "skipped" in line]
    assert summary_line, "each skipped step is reported"


def test_a_blown_up_update_never_costs_the_last_good_checkpoint(tmp_path, cache_dir, trained_run):
    """Resumed with train.lr=1e10 and keep_last=1: step 5's loss is finite and its update blows the
    weights up, step 6's loss is not. The save at step 5 is set aside as step-000005.diverged (no
    healthy step followed it), none is written inside the streak, and step 4, the last good one,
    is never rotated out: the re-run with a sane lr resumes from it. (Before, the save at step 6
    held step 5's weights and rotated step 4 out.)"""
    out = tmp_path / "run"
    common = {"train.max_steps": 8, "train.checkpoint_every": 2, "train.keep_last": 1, "train.eval_every": 100}
    trained_run(out, **common, **{"train.stop_at_step": 4})
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{
        **common, "train.lr": 1e10, "train.checkpoint_every": 1, "train.max_bad_steps": 2}))
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("cputrain: error: training diverged:") and "step-000004" in last, last
    assert "set aside, never loaded: step-000005.diverged" in last, last
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000004", "step-000005.diverged"]
    assert "checkpoint not written: 1 bad step(s) in a row" in proc.stderr

    again = run_cli("train", *tiny_overrides(out, cache_dir, **common), check=True)
    assert "(step 4)" in again.stderr
    assert all(math.isfinite(loss) for loss in _losses(out).values())


def test_an_update_that_leaves_inf_weights_is_a_bad_step_and_nothing_is_exported(tmp_path, cache_dir):
    """lr=1e39 (finite as a setting, inf as an fp32 update): step 1's loss and gradient norm are
    finite, its weights are not. No checkpoint holds them and no model/ is exported (before: exit 0
    and an export whose every weight was non-finite)."""
    out = tmp_path / "run"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{
        "train.lr": 1e39, "train.warmup_steps": 0, "train.max_steps": 2, "train.checkpoint_every": 1}))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "step 1: loss" in proc.stderr and "the update left non-finite weights" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "the update of step 1 left non-finite weights" in last and "nothing is exported" in last, last
    assert not (out / "model").exists()
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _tensors(value)


def test_eval_and_generate_on_a_model_with_nan_weights(tmp_path, tiny_model_dir, cache_dir):
    """A diverged model: eval prints valid JSON (the loss is null, not NaN), generate one line."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan-model"
    shutil.copytree(tiny_model_dir, folder)
    weights = load_file(folder / "model.safetensors")
    name = next(k for k in weights if k.endswith("mlp.down_proj.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})

    ev = run_cli("eval", folder, f"data.cache_dir={cache_dir}", "data.max_documents=200", "data.seq_len=32",
                 "--max-sequences", "8")
    assert ev.returncode == 0, ev.stderr[-2000:]
    result = json.loads(ev.stdout)  # strict JSON: json.loads accepts NaN, so check the text too
    assert "NaN" not in ev.stdout and result["val_loss"] is None and result["val_ppl"] is None

    gen = run_cli("generate", folder, "--prompt", "The")
    assert gen.returncode == 2 and "Traceback" not in gen.stderr
    assert gen.stderr.strip().splitlines()[-1].startswith("cputrain: error: the model in") and name in gen.stderr


def _damage(folder, how: str) -> None:
    state = folder / "state"
    shard = sorted(state.glob("*.distcp"))[0]
    if how == "truncated shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how == "missing shard":
        shard.unlink()
    elif how == "missing .metadata":
        (state / ".metadata").unlink()
    elif how == "empty .metadata":
        (state / ".metadata").write_bytes(b"")
    elif how == "empty trainer_state.json":
        (folder / "trainer_state.json").write_text("")


DAMAGE = ["truncated shard", "missing shard", "missing .metadata", "empty .metadata", "empty trainer_state.json"]


TWELVE = {"train.max_steps": 12, "train.checkpoint_every": 5, "train.eval_every": 100}


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_resumes(tmp_path, cache_dir, trained_run):
    """Each kind of damage: one line naming the folder and what is wrong, the folder kept as
    step-N.damaged, and the run resumed from the previous checkpoint with the losses of a run
    never damaged."""
    common = TWELVE
    straight = tmp_path / "straight"
    run_cli("train", *tiny_overrides(straight, cache_dir, **common), check=True)
    reference = _losses(straight)
    first = tmp_path / "first"  # checkpoints at steps 5 and 10, the schedule of 12 steps
    trained_run(first, **common, **{"train.stop_at_step": 10})
    import shutil

    for how in DAMAGE:
        out = tmp_path / how.replace(" ", "-")
        shutil.copytree(first, out)
        _damage(out / "checkpoints" / "step-000010", how)
        proc = run_cli("train", *tiny_overrides(out, cache_dir, **common))
        assert proc.returncode == 0, (how, proc.stderr[-2000:])
        lines = [line for line in proc.stderr.splitlines() if "is damaged" in line]
        assert len(lines) == 1 and "step-000010" in lines[0] and "step-000010.damaged" in lines[0], (how, lines)
        assert "(step 5)" in proc.stderr, how
        assert (out / "checkpoints" / "step-000010.damaged").is_dir(), how  # kept, never deleted
        losses = _losses(out)
        assert all(losses[s] == reference[s] for s in range(6, 13)), how


def test_no_intact_checkpoint_left_is_one_line_and_exit_2(tmp_path, cache_dir, trained_run):
    out = tmp_path / "run"  # checkpoints at steps 5 and 10 (the run the test above damages one of)
    trained_run(out, **TWELVE, **{"train.stop_at_step": 10})
    _damage(out / "checkpoints" / "step-000005", "missing .metadata")
    _damage(out / "checkpoints" / "step-000010", "truncated shard")
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **TWELVE))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("cputrain: error: no intact checkpoint is left") and "step 10 (state/" in last, last
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000005.damaged", "step-000010.damaged"]


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, cache_dir, trained_run):
    """output_dir on a tmpfs with room for one checkpoint and a half: the second save fills it."""
    import os
    import subprocess as sp

    common = {"train.max_steps": 10, "train.checkpoint_every": 5, "train.eval_every": 100}
    # a checkpoint of the same model and optimizer (its size does not depend on the schedule's
    # length): the run the tests above resume, trained once
    sized = tmp_path / "sized"
    trained_run(sized, **TWELVE, **{"train.stop_at_step": 10})
    one = sum(f.stat().st_size for f in (sized / "checkpoints" / "step-000005").rglob("*") if f.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or sp.run(["mount", "-t", "tmpfs", "-o", f"size={int(one * 1.6) // 4096 * 4096 + 8192}",
                                    "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        out = disk / "run"
        proc = run_cli("train", *tiny_overrides(out, cache_dir, **common))
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("cputrain: error: the disk filled while saving checkpoint step 10"), last
        assert "MiB free" in last and "a checkpoint of this run takes" in last and "step-000005 is kept" in last, last
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000005"]  # no .tmp left
        assert not (out / "run.lock").exists()
    finally:
        sp.run(["umount", "-l", str(disk)], check=False)


def test_checkpoint_every_s_saves_by_the_clock(tmp_path, cache_dir):
    out = tmp_path / "run"
    run_cli("train", *tiny_overrides(out, cache_dir, **{
        "train.max_steps": 6, "train.checkpoint_every": 1000, "train.checkpoint_every_s": 0.001,
        "train.keep_last": 10, "train.eval_every": 1000}), check=True)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{s:06d}" for s in range(1, 7)]


def test_a_changed_lr_on_resume_is_the_lr_used(tmp_path, cache_dir):
    """train.lr changed between sessions: from the resumed step on, the lr of each step is the
    new peak on the same schedule (that of a run started with it), as config.yaml then says."""
    common = {"train.max_steps": 10, "train.checkpoint_every": 100, "train.eval_every": 100, "train.warmup_steps": 2}
    reference, out = tmp_path / "reference", tmp_path / "run"
    run_cli("train", *tiny_overrides(reference, cache_dir, **common, **{"train.lr": 1e-3}), check=True)
    run_cli("train", *tiny_overrides(out, cache_dir, **common, **{"train.lr": 3e-3, "train.stop_at_step": 5}), check=True)
    resumed = run_cli("train", *tiny_overrides(out, cache_dir, **common, **{"train.lr": 1e-3}), check=True)
    assert "train.lr is 0.001 (the checkpoint's schedule peaked at 0.003)" in resumed.stderr

    def lrs(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["lr"] for r in rows if "lr" in r}

    a, b = lrs(reference), lrs(out)
    assert all(b[s] == a[s] for s in range(6, 11)), (a, b)
    assert b[5] == pytest.approx(3 * a[5])  # the first session ran at its own lr
    assert "lr: 0.001" in (out / "config.yaml").read_text()


def test_thread_settings_that_are_not_used_are_said_in_one_line(tmp_path, cache_dir):
    """More threads than CPUs, or a user's OMP_NUM_THREADS: one warning line each saying what
    cputrain does instead, and config.yaml records the value in use."""
    import os

    cpus = len(os.sched_getaffinity(0))
    out = tmp_path / "run"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{"train.max_steps": 2, "hardware.threads": 64 * cpus}),
                   env=cli_env(OMP_NUM_THREADS=7), check=True)
    too_many = [line for line in proc.stderr.splitlines() if f"hardware.threads={64 * cpus} × 1 rank(s)" in line]
    assert len(too_many) == 1 and "using" in too_many[0], proc.stderr[-2000:]
    used = int(too_many[0].split("using ")[1].split()[0])
    assert 1 <= used <= cpus
    omp = [line for line in proc.stderr.splitlines() if "OMP_NUM_THREADS=7 is set in the environment" in line]
    assert len(omp) == 1 and f"hardware.threads ({used} here)" in omp[0], proc.stderr[-2000:]
    assert f"threads: {used}" in (out / "config.yaml").read_text()
