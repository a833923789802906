"""KTO through the CLI on a tiny model: LoRA KTO on string feedback starts at 0.5 (the policy is
its reference, z = 0), logs TRL's figures per step and at validation and puts them in summary.json;
`cputrain eval` gives the run's own validation figures; a stopped and resumed run equals a
straight one (the reference read back from beside the token cache); two ranks take one rank's
first steps (the KL estimate over the whole global batch); full weights on builtin:pydoc-kto
(conversations, found by data.format=auto) start at 0.5 against their stored reference; feedback
that is not boolean, and KTO on pairs, are refused in one line."""

from __future__ import annotations

import json
import math

import pytest

from harness.run_cli import run_cli
from harness.run_cli_here import run_cli_here
from harness.run_metrics import losses_by_step, metrics_rows
from harness.tiny_run import tiny_overrides

KTO = {"data.format": "feedback", "data.seq_len": 128, "data.val_fraction": 0.1, "data.max_documents": "null",
       "train.objective": "kto", "model.lora.enabled": "true", "model.lora.rank": 4, "train.lr": 1e-2,
       "train.max_steps": 6, "train.eval_every": 3, "train.checkpoint_every": 3}
KEYS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model()


@pytest.fixture(scope="module", autouse=True)
def feedback(tmp_path_factory):
    """Answers to pydoc questions, two of three with a thumbs-up: the run's data.source."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("feedback") / "feedback.jsonl"
    names = sorted(topics)[:60]
    with open(path, "w") as f:
        for i, name in enumerate(names):
            answer = " " + " ".join(topics[name].split())[: 40 + 10 * (i % 4)]
            f.write(json.dumps({"prompt": f"Question: what is {name}?\nAnswer:", "completion": answer,
                                "label": i % 3 != 0}) + "\n")
    KTO["data.source"] = str(path)
    return path


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir, base):
    out = tmp_path_factory.mktemp("kto") / "straight"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{"model.name_or_path": base, **KTO}), check=True)
    assert "KTO reference:" in proc.stderr and "computed before training" in proc.stderr, proc.stderr[-2000:]
    # 40 desirable and 20 undesirable: TRL's warning with the weights the KTO paper recommends
    assert "train.kto_desirable_weight in [" in proc.stderr, proc.stderr[-2000:]
    return out


def test_lora_kto_starts_at_one_half_and_records_trls_figures(straight):
    rows = metrics_rows(straight)
    first = rows[0]
    # at step 1 the adapters are zero: the policy is its reference, every reward and z 0
    assert first["step"] == 1 and abs(first["loss"] - 0.5) < 1e-6
    assert first["kl"] == 0 and first["rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert all(key in r for r in rows if "loss" in r for key in KEYS)
    # after one update the policy has moved away from its reference (z may be clamped at 0 yet)
    assert rows[1]["loss"] != first["loss"] and rows[1]["rewards/margins"] != 0
    assert any(r["kl"] > 0 for r in rows if "loss" in r)
    evals = [r for r in rows if "eval_kl" in r]
    assert [r["step"] for r in evals] == [3, 6] and all(math.isfinite(r["val_loss"]) for r in evals)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["objective"] == "kto" and summary["lora"] is True
    for key in KEYS:  # TRL's figures of the last step and validation
        assert summary[key] == [r for r in rows if "loss" in r][-1][key] and summary[f"eval_{key}"] == evals[-1][f"eval_{key}"]


def test_eval_gives_the_runs_own_validation_figures(straight):
    last = [r for r in metrics_rows(straight) if "eval_kl" in r][-1]
    result = json.loads(run_cli("eval", straight, "--max-sequences", 8, check=True).stdout)
    assert result["objective"] == "kto" and result["examples"] > 0
    assert result["reference"] == "the LoRA base, adapters off"
    assert result["loss"] == pytest.approx(last["val_loss"], abs=1e-5)
    for key in KEYS:
        assert result[key] == pytest.approx(last[f"eval_{key}"], abs=1e-5), key


def test_stop_and_resume_equals_the_straight_run(tmp_path, cache_dir, base, straight):
    split = tmp_path / "split"
    overrides = {"model.name_or_path": base, **KTO}
    run_cli("train", *tiny_overrides(split, cache_dir, **overrides, **{"train.stop_at_step": 3}), check=True)
    resumed = run_cli("train", *tiny_overrides(split, cache_dir, **overrides), check=True)
    assert "resumed from" in resumed.stderr and "read from" in resumed.stderr, resumed.stderr[-2000:]
    a, b = losses_by_step(straight), losses_by_step(split)
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert a[step] == pytest.approx(b[step], abs=1e-6), step


def test_two_ranks_take_one_ranks_first_step(tmp_path, cache_dir, base, straight):
    """Each rank runs its share of the step's KL sequences; one all-reduce makes z: the first two
    steps' losses and KL estimates are the single rank's."""
    out = tmp_path / "ranks2"
    run_cli("train", *tiny_overrides(out, cache_dir, **{"model.name_or_path": base, **KTO, "train.max_steps": 2,
                                                        "train.micro_batch_size": 2}),
            "--nproc-per-node", "2", check=True)
    one, two = [r for r in metrics_rows(straight) if "loss" in r], [r for r in metrics_rows(out) if "loss" in r]
    for step in (0, 1):
        for key in ("loss", "grad_norm", "kl", "rewards/chosen"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-6), (step, key)


def test_full_weights_start_at_one_half_against_their_stored_reference(tmp_path, cache_dir, base):
    out = tmp_path / "full"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{
        "model.name_or_path": base, **KTO, "data.source": "builtin:pydoc-kto", "data.format": "auto",
        "data.seq_len": 256, "model.lora.enabled": "false", "train.lr": 1e-3, "train.max_steps": 2,
        "train.eval_every": 2}), check=True)
    assert "auto: data.format = feedback" in proc.stderr, proc.stderr[-2000:]
    rows = [r for r in metrics_rows(out) if "loss" in r]
    assert abs(rows[0]["loss"] - 0.5) < 1e-6 and rows[1]["rewards/margins"] != 0
    # eval computes the reference from the folder the run started from, then loads the trained model
    last = [r for r in metrics_rows(out) if "eval_kl" in r][-1]
    result = json.loads(run_cli("eval", out, "--max-sequences", 8, check=True).stdout)
    assert result["reference"] == str(base)
    assert result["loss"] == pytest.approx(last["val_loss"], abs=1e-5)
    assert result["kl"] == pytest.approx(last["eval_kl"], abs=1e-5)


def test_a_label_that_is_not_boolean_stops_in_one_line(tmp_path, cache_dir, base):
    data = tmp_path / "feedback.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i} ", "completion": f"answer {i}", "label": "good"}) + "\n"
                            for i in range(20)))
    proc = run_cli("train", *tiny_overrides(tmp_path / "run", cache_dir, **{
        "model.name_or_path": base, **KTO, "data.source": data}))
    assert proc.returncode != 0 and "field 'label' must be true" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra, expect", [
    ({"data.source": "builtin:pydoc-dpo", "data.format": "auto"},
     "train.objective=kto trains on answers each with a thumbs-up or down"),
    ({"train.objective": "reward"}, "train.objective=reward trains on preference pairs, but data.format is feedback"),
])
def test_an_objective_on_the_wrong_data_is_refused_before_work(tmp_path, cache_dir, base, extra, expect):
    proc = run_cli_here("train", *tiny_overrides(tmp_path / "run", cache_dir, **{
        "model.name_or_path": base, **KTO, **extra}))
    assert proc.returncode == 2 and expect in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()
