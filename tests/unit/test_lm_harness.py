"""`cputrain eval RUN --tasks`: lm-evaluation-harness on a run's model, in this process and
offline, on a multiple-choice task whose data ships here (lm_eval_task/questions.jsonl: 12
questions of four answers). What the harness computed is checked against the model's own loss
on the same text, so the test fails if another model (or none) was wrapped."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest

from conftest import run_cli_here

QUESTIONS_FILE = Path(__file__).parent / "lm_eval_task" / "questions.jsonl"
QUESTIONS = [json.loads(line) for line in QUESTIONS_FILE.read_text().splitlines()]
TASK = "cputrain_tiny_mc"
PROMPT = "Question: {question}\nAnswer:"  # the YAML's doc_to_text, as Python formats it

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm_eval is not installed (the `eval` extra: pip install 'cputrain[eval]')")


def write_task(folder: Path) -> Path:
    """The task YAML, its data the shipped JSONL (an absolute path: the harness reads data_files
    from the working folder) and the datasets cache under `folder` (not the user's)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny_mc.yaml"
    path.write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {QUESTIONS_FILE}
  cache_dir: {folder / "datasets-cache"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return path


@pytest.fixture
def run_dir(tmp_path, tiny_model_dir) -> Path:
    """A run folder whose model/ is a copy of the session's tiny Llama (results go into the run)."""
    shutil.copytree(tiny_model_dir, tmp_path / "run" / "model")
    return tmp_path / "run"


@pytest.fixture
def torch_threads():
    """The command sets torch's thread count in this process; the next test gets it back."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def answer_logprobs(model_dir: Path) -> list[list[float]]:
    """Each answer's log-probability after its question, from the model's own summed loss (the
    call cputrain's validation loss makes), the answer's tokens alone labelled."""
    import torch

    from cputrain.finished.load import load_for_inference

    model, tokenizer = load_for_inference(str(model_dir))
    out = []
    with torch.no_grad():
        for q in QUESTIONS:
            context = PROMPT.format(**q)
            n_context = len(tokenizer(context)["input_ids"])
            row = []
            for choice in q["choices"]:
                ids = tokenizer(f"{context} {choice}")["input_ids"]
                labels = [-100] * n_context + ids[n_context:]
                loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]), num_items_in_batch=1).loss
                row.append(-float(loss))
            out.append(row)
    return out


def _one_line_refusal(proc, *words):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


@needs_lm_eval
def test_tasks_print_a_table_and_write_what_the_run_model_scores(run_dir, tmp_path, torch_threads):
    task = write_task(tmp_path / "task")
    proc = run_cli_here("eval", run_dir, "--tasks", task, "hardware.precision=fp32", "hardware.threads=1",
                        "--batch-size", "3", check=True)
    assert "fp32, 1 thread(s), batch 3" in proc.stderr  # the one line saying how the model runs
    header, row = proc.stdout.splitlines()[:2]
    assert header.split() == ["task", "n", "metric", "value", "stderr"]
    assert row.split()[:3] == [TASK, str(len(QUESTIONS)), "acc"]

    result = json.loads((run_dir / "eval" / f"{TASK}.json").read_text())
    assert 0 <= result["metrics"]["acc"]["value"] <= 1 and result["metrics"]["acc"]["stderr"] > 0
    assert result["n_samples"] == {"original": len(QUESTIONS), "effective": len(QUESTIONS)}
    assert (result["model"], result["precision"], result["threads"]) == (str(run_dir / "model"), "fp32", 1)

    # The harness's log-likelihood of every answer is the run's model's own, and so is each choice.
    samples = [json.loads(line) for line in (run_dir / "eval" / f"{TASK}.samples.jsonl").read_text().splitlines()]
    expected = answer_logprobs(run_dir / "model")
    assert len(samples) == len(QUESTIONS)
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        got = [ll for ll, _greedy in sample["filtered_resps"]]
        want = expected[sample["doc_id"]]
        assert got == pytest.approx(want, abs=1e-4), (sample["doc"], got, want)
        chosen = max(range(len(want)), key=want.__getitem__)
        assert sample["acc"] == float(chosen == sample["target"])
    assert result["metrics"]["acc"]["value"] == pytest.approx(
        sum(max(range(4), key=row.__getitem__) == q["answer"] for row, q in zip(expected, QUESTIONS)) / len(QUESTIONS))

    # Again with --limit and one example in each prompt: a new file beside the first, kept as it was.
    first = (run_dir / "eval" / f"{TASK}.json").read_text()
    proc = run_cli_here("eval", run_dir, "--tasks", task, "--limit", "5", "--num-fewshot", "1", "hardware.threads=1",
                        check=True)
    assert f"{TASK}-2.json" in proc.stdout
    again = json.loads((run_dir / "eval" / f"{TASK}-2.json").read_text())
    assert again["n_samples"]["effective"] == 5 and again["num_fewshot"] == 1
    context = json.loads((run_dir / "eval" / f"{TASK}-2.samples.jsonl").read_text().splitlines()[0])["arguments"][0][0]
    assert context.count("Question:") == 2, context
    assert (run_dir / "eval" / f"{TASK}.json").read_text() == first


@needs_lm_eval
def test_a_lora_run_is_evaluated_as_its_adapters_on_their_base(tmp_path, tiny_model_dir, torch_threads):
    """A LoRA run's model/ is an adapter folder: the harness gets the peft model that `generate`
    loads, and its answers' log-likelihoods are the adapted model's, not the base's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # init_lora_weights=False: random B as well as A, so the adapters change what the model says
    with warnings.catch_warnings():  # peft asks transformers 5 for a renamed attribute; nothing to act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    run = tmp_path / "lora-run"
    adapted.save_pretrained(run / "model")
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(run / "model")

    proc = run_cli_here("eval", run, "--tasks", write_task(tmp_path / "task"), "--limit", "4",
                        "hardware.precision=fp32", "hardware.threads=1", check=True)
    assert "LoRA adapters on their base" in proc.stderr
    samples = [json.loads(line) for line in (run / "eval" / f"{TASK}.samples.jsonl").read_text().splitlines()]
    expected, of_base = answer_logprobs(run / "model"), answer_logprobs(tiny_model_dir)
    for sample in samples:
        got = [ll for ll, _greedy in sample["filtered_resps"]]
        assert got == pytest.approx(expected[sample["doc_id"]], abs=1e-4)
        assert got != pytest.approx(of_base[sample["doc_id"]], abs=1e-2)


def test_tasks_without_lm_eval_is_one_line(run_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    proc = run_cli_here("eval", run_dir, "--tasks", "hellaswag")
    _one_line_refusal(proc, "not installed", "pip install 'cputrain[eval]'")


def test_tasks_on_a_run_without_a_model_is_one_line(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    _one_line_refusal(run_cli_here("eval", tmp_path / "run", "--tasks", "hellaswag"), "has no exported model yet")


@needs_lm_eval
def test_unknown_task_and_missing_file_are_one_line(run_dir, tmp_path):
    _one_line_refusal(run_cli_here("eval", run_dir, "--tasks", tmp_path / "nowhere.yaml"), "not found")
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "_base.yaml").write_text("dataset_path: json\n")
    _one_line_refusal(run_cli_here("eval", run_dir, "--tasks", tmp_path / "templates"), "holds no task YAML")
    # A name that is neither a file nor in the harness's registry (its index: every task it ships).
    _one_line_refusal(run_cli_here("eval", run_dir, "--tasks", "no_such_task_anywhere"),
                      "unknown task 'no_such_task_anywhere'")


def test_harness_flags_without_tasks_are_refused(run_dir):
    _one_line_refusal(run_cli_here("eval", run_dir, "--limit", "3"), "--limit goes with --tasks")


@needs_lm_eval
def test_a_group_gets_a_row_and_a_file_of_its_own(tmp_path):
    """A group's aggregate (the harness's results without a task config) is reported beside its
    tasks; its file lists them instead of a config, and it has no samples of its own."""
    from cputrain.finished.lm_harness import table_lines, write_results

    def task(acc):
        return {"alias": "t", "sample_len": 3, "acc,none": acc, "acc_stderr,none": 0.1, "acc_norm,none": 0.5,
                "acc_norm_stderr,none": "N/A"}

    results = {"results": {"a": task(0.25), "b": task(0.75), "grp": {"sample_len": 6, "acc,none": 0.5,
                                                                    "acc_stderr,none": 0.2}},
               "configs": {"a": {"task": "a"}, "b": {"task": "b"}}, "group_subtasks": {"grp": ["a", "b"]},
               "n-samples": {"a": {"original": 12, "effective": 3}, "b": {"original": 12, "effective": 3}},
               "samples": {"a": [{"doc_id": 0}], "b": [{"doc_id": 0}]}, "versions": {}}
    written = write_results(results, tmp_path, {"precision": "fp32"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "a.samples.jsonl", "b.json", "b.samples.jsonl",
                                                         "grp.json"]
    group = json.loads(written["grp"].read_text())
    assert group["group_tasks"] == ["a", "b"] and group["n_samples"] == {"effective": 6}
    assert json.loads(written["a"].read_text())["metrics"]["acc_norm"] == {"value": 0.5, "stderr": None}
    rows = [line.split() for line in table_lines(results, written)]
    assert ["grp", "6", "acc", "0.5000", "0.2000"] in rows and ["a", "3", "acc_norm", "0.5000"] in rows
    assert write_results(results, tmp_path, {})["a"].name == "a-2.json"  # the first result is kept
