"""Every figure says what it is: `eval` on data without validation rows says it used the training
rows; a preference, feedback or reward run's summary shows no perplexity (exp of its loss is none)
and counts its own items; `eval` of a KTO model scores one-label feedback (only training needs both
labels), names its reference when that folder is gone, and refuses benchmark tasks on a reward
model in one line. Through the command's entry function, in this process, on the tiny Llama."""

from __future__ import annotations

import json
import shutil

import pytest

from harness.run_cli_here import run_cli_here
from harness.tiny_run import tiny_overrides


def _eval_overrides(tmp_path, **extra) -> list[str]:
    """eval's key=value overrides: the tiny run's data settings (no model.arch: the folder has one)."""
    return [o for o in tiny_overrides(tmp_path / "run", tmp_path / "cache", **extra)
            if not o.startswith(("model.arch", "model.tokenizer_vocab_size", "output_dir"))]


def _feedback(path, labels) -> str:
    path.write_text("".join(json.dumps({"prompt": f"Question {i}: what is a list?", "completion": f" answer {i}",
                                        "label": label}) + "\n" for i, label in enumerate(labels)))
    return str(path)


def test_eval_without_validation_rows_says_it_used_the_training_rows(tmp_path, tiny_model_dir):
    proc = run_cli_here("eval", tiny_model_dir, *_eval_overrides(tmp_path, **{"data.val_fraction": 0,
                                                                             "data.max_documents": 40}),
                        "--max-sequences", 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["split"] == "train" and "no validation rows" in result["note"], result
    assert "these figures are on the training rows" in proc.stderr


def test_eval_of_kto_scores_feedback_of_one_label(tmp_path, tiny_model_dir):
    """Training refuses feedback of one label (KTO learns from both kinds); evaluation does not."""
    data = _feedback(tmp_path / "up.jsonl", [True] * 12)
    proc = run_cli_here("eval", tiny_model_dir, *_eval_overrides(tmp_path, **{
        "train.objective": "kto", "model.name_or_path": tiny_model_dir, "data.source": data,
        "data.format": "feedback", "data.seq_len": 64, "data.val_fraction": 0.25, "data.max_documents": "null"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["objective"] == "kto" and result["examples"] == 3 and result["rewards/rejected"] is None
    assert result["split"] == "val" and "note" not in result


def test_training_and_prepare_still_refuse_feedback_of_one_label(tmp_path, tiny_model_dir):
    data = _feedback(tmp_path / "down.jsonl", [False] * 12)
    proc = run_cli_here("prepare", *tiny_overrides(tmp_path / "run", tmp_path / "cache", **{
        "train.objective": "kto", "model.name_or_path": tiny_model_dir, "data.source": data,
        "data.format": "feedback", "data.seq_len": 64, "data.max_documents": "null"}))
    assert proc.returncode == 2 and "has label=false: KTO learns from both kinds" in proc.stderr, proc.stderr[-3000:]


def test_eval_of_a_kto_run_whose_reference_moved_says_it_is_the_reference(tmp_path, tiny_model_dir):
    gone = tmp_path / "moved-away"
    proc = run_cli_here("eval", tiny_model_dir, *_eval_overrides(tmp_path, **{
        "train.objective": "kto", "model.name_or_path": gone, "data.format": "feedback"}))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert f"this KTO run's reference is the model it started from, model.name_or_path='{gone}'" in line
    assert f"cputrain eval {tiny_model_dir} model.name_or_path=FOLDER" in line


def test_benchmark_tasks_on_a_reward_model_are_one_line(tmp_path, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path / "reward"
    shutil.copytree(tiny_model_dir, folder)
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(folder)
    proc = run_cli_here("eval", folder, "--tasks", "hellaswag", "--limit", "2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "is a reward model: it scores text and has no next-token probabilities" in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize("objective, items", [("kto", "feedback examples"), ("reward", "preference pairs")])
def test_a_preference_runs_summary_shows_its_own_figures_not_a_perplexity(objective, items):
    from cputrain.metrics.summary import summary_table

    summary = {"final_step": 4, "final_loss": 0.4, "val_loss": 0.45, "first_val_loss": 0.5, "objective": objective,
               "items": items, "pairs_per_s": 12.0, "pairs_per_step": 8.0, "world_size": 1}
    table = "\n".join(summary_table(summary))
    assert "perplexity" not in table and f"{items}/s" in table and f"{items} per step" in table
    lm = "\n".join(summary_table({"final_step": 4, "val_loss": 2.0, "val_ppl": 7.39, "world_size": 1}))
    assert "validation perplexity        7.39" in lm and "pairs" not in lm


def test_validation_of_a_preference_objective_records_no_perplexity():
    from types import SimpleNamespace

    from cputrain.metrics.run_metrics import RunMetrics

    for perplexity in (True, False):
        metrics = RunMetrics.__new__(RunMetrics)
        metrics.perplexity, metrics.ranks, metrics._window_t0 = perplexity, SimpleNamespace(is_main=False), 0.0
        row = metrics.with_validation(None, 3, 0.5)
        assert ("val_ppl" in row) is perplexity and row["val_loss"] == 0.5


@pytest.mark.parametrize("objective, expect", [
    ("dpo", "train.objective=dpo trains on preference pairs, but data.format is feedback"),
    ("reward", "train.objective=reward trains on preference pairs, but data.format is feedback"),
])
def test_eval_under_an_objective_the_data_does_not_fit_is_one_line(tmp_path, tiny_model_dir, objective, expect):
    """`eval RUN train.objective=…` over another objective's data ended in an AttributeError."""
    data = _feedback(tmp_path / "fb.jsonl", [True, False] * 6)
    proc = run_cli_here("eval", tiny_model_dir, *_eval_overrides(tmp_path, **{
        "train.objective": objective, "model.name_or_path": tiny_model_dir, "data.source": data,
        "data.format": "feedback"}))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert expect in proc.stderr.strip().splitlines()[-1]


def test_eval_of_a_language_model_as_a_reward_model_is_one_line(tmp_path, tiny_model_dir):
    proc = run_cli_here("eval", tiny_model_dir, *_eval_overrides(tmp_path, **{
        "train.objective": "reward", "data.source": "builtin:pydoc-dpo", "data.format": "preference"}))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "train.objective=reward evaluates a reward model (a score head), and the model in" in proc.stderr
