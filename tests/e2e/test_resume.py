"""Resume: 20 steps straight give the very same losses and weights as 10, a stop, and 10 more
(fp32); only complete step folders are loaded, and the last K are kept."""

from __future__ import annotations

import json

from harness.run_cli import run_cli
from harness.tiny_run import tiny_overrides


def _losses(out) -> dict[int, tuple]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r.get("loss"), r.get("val_loss")) for r in rows}


def _steps(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_stop_and_resume_equals_straight_run(tmp_path, cache_dir):
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = {"train.max_steps": 20, "train.eval_every": 5, "train.checkpoint_every": 5}
    run_cli("train", *tiny_overrides(straight, cache_dir, **common, **{"train.keep_last": 3}), check=True)

    first = run_cli("train", *tiny_overrides(split, cache_dir, **common, **{"train.stop_at_step": 7}), check=True)
    assert max(_losses(split)) == 7
    assert _steps(split) == ["step-000005", "step-000007"]  # a checkpoint where it stopped
    assert "resumed" not in first.stderr

    # Leftovers of a save killed mid-write: a .tmp folder, even one that looks finished, is never loaded.
    fake = split / "checkpoints" / "step-000015.tmp"
    (fake / "state").mkdir(parents=True)
    (fake / "trainer_state.json").write_text(json.dumps({"step": 15, "schedule": {}}))
    (fake / "state" / "garbage.distcp").write_bytes(b"not a checkpoint")

    second = run_cli("train", *tiny_overrides(split, cache_dir, **common), check=True)
    assert "(step 7)" in second.stderr and "resumed from" in second.stderr

    a, b = _losses(straight), _losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 21))
    for step in range(1, 21):
        assert a[step][0] == b[step][0], f"train loss differs at step {step}: {a[step][0]} vs {b[step][0]}"
    for step in (5, 10, 15, 20):
        assert a[step][1] == b[step][1], f"validation loss differs at step {step}"

    from safetensors.torch import load_file

    wa, wb = load_file(straight / "model" / "model.safetensors"), load_file(split / "model" / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)

    # keep_last: 3 in the straight run, the default 2 in the other; the .tmp leftover is gone.
    assert _steps(straight) == ["step-000010", "step-000015", "step-000020"]
    assert _steps(split) == ["step-000015", "step-000020"]
    summary = json.loads((split / "summary.json").read_text())
    assert summary["final_step"] == 20 and summary["steps_this_session"] == 13


def test_resume_skips_an_incomplete_step_folder(tmp_path, cache_dir):
    """A step folder without trainer_state.json (written last) does not count as complete."""
    from cputrain.run_folder.layout import RunFolder

    run = RunFolder(str(tmp_path))
    for name, complete in (("step-000010", True), ("step-000020", False), ("step-000030.tmp", True)):
        folder = tmp_path / "checkpoints" / name
        folder.mkdir(parents=True)
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    assert run.complete_steps() == [10] and run.newest_complete() == 10
    run.prune(keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000010", "step-000020"]


def test_steps_trained_again_after_a_lost_checkpoint_are_logged_once(tmp_path, cache_dir):
    """A run that dies after logging steps 6 and 7 but before its step-7 checkpoint is complete
    trains 6 and 7 again from step 5: metrics.jsonl then holds each step once, with the losses
    of the steps as trained in the session that finished them (the same, in fp32)."""
    import shutil

    out = tmp_path / "run"
    common = {"train.max_steps": 10, "train.eval_every": 100, "train.checkpoint_every": 5}
    run_cli("train", *tiny_overrides(out, cache_dir, **common, **{"train.stop_at_step": 7}), check=True)
    first = {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    shutil.rmtree(out / "checkpoints" / "step-000007")  # as if killed before this save completed

    second = run_cli("train", *tiny_overrides(out, cache_dir, **common), check=True)
    assert "(step 5)" in second.stderr and "2 row(s) after step 5 dropped" in second.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, 11)), f"each step once, in order: {steps}"
    for r in rows[:7]:
        assert r["loss"] == first[r["step"]], f"step {r['step']}: {r['loss']} vs {first[r['step']]} before the checkpoint was lost"
