"""The files each command reads or writes, checked as `train` checks its data: a missing folder, a
folder where a file belongs, bytes that are not UTF-8 and malformed lines each end in one line and
exit 2, before any work (through the command's entry function, in this process); an output is
written whole or not at all, and a refused preparation leaves no partial cache entry behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.run_cli_here import run_cli_here
from harness.tiny_run import tiny_overrides

NOT_UTF8 = b'{"text": "caf\xe9"}\n'  # latin-1, as a spreadsheet saves it
K8S = ["--name", "a", "--image", "i", "--nnodes", "1", "--nproc-per-node", "1"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A folder of bad files and one folder, each named by what it is."""
    here = tmp_path_factory.mktemp("files")
    (here / "latin1.yaml").write_bytes(b"train:\n  max_steps: 2 # \xe9t\xe9\n")
    (here / "latin1.jsonl").write_bytes(b'{"prompt": "a", "completion": "b"}\n' + NOT_UTF8)
    (here / "latin1.json").write_bytes(b'[{"name": "c\xe9", "vcpus": 4, "memory_gib": 8}]\n')
    (here / "records.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    (here / "a-folder").mkdir()
    (here / "records.parquet").write_bytes(b"PAR1 not really\n")  # the suffix is what is refused
    return here


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny Llama as a sequence classifier with one output: a reward model's folder."""
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path_factory.mktemp("reward") / "model"
    shutil.copytree(tiny_model_dir, folder)
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory, tiny_model_dir) -> Path:
    """A LoRA adapter folder on the tiny Llama, as peft saves one."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("lora") / "model"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                           LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    model.save_pretrained(folder)
    return folder


# (command line with {files}, {model} (a reward model), {lm} (a causal LM) and {lora} (its adapters)
# for the fixtures' folders, what its one line says)
CASES = {
    "train config not UTF-8": (["train", "{files}/latin1.yaml"], "'{files}/latin1.yaml' line 2 is not UTF-8"),
    "prepare config not UTF-8": (["prepare", "{files}/latin1.yaml"], "line 2 is not UTF-8 text (byte 0xe9)"),
    "eval config not UTF-8": (["eval", "{model}", "{files}/latin1.yaml"], "line 2 is not UTF-8"),
    "eval of a missing folder": (["eval", "{files}/gone"], "is neither a run folder nor a model folder"),
    "generate of a folder with no model": (["generate", "{files}/a-folder"], "is neither a run folder"),
    "score data not UTF-8": (["score", "{model}", "--data", "{files}/latin1.jsonl"],
                             "latin1.jsonl line 2 is not UTF-8 text (byte 0xe9 at column 14)"),
    "score data a folder": (["score", "{model}", "--data", "{files}/a-folder"], "is not a file"),
    "score data not JSON": (["score", "{model}", "--data", "{files}/latin1.yaml"], "line 1 is not JSON"),
    "score out a folder": (["score", "{model}", "--data", "{files}/records.jsonl", "--out", "{files}/a-folder"],
                           "--out '{files}/a-folder' is a folder; name a file"),
    "score out in a missing folder": (["score", "{model}", "--data", "{files}/records.jsonl", "--out",
                                       "{files}/gone/scored.jsonl"], "folder '{files}/gone' does not exist"),
    "score data a parquet file": (["score", "{model}", "--data", "{files}/records.parquet"],
                                  "is a parquet file; score reads .jsonl"),
    "score out on a file system that takes no file": (["score", "{model}", "--data", "{files}/records.jsonl",
                                                       "--out", "/proc/scored.jsonl"],
                                                      "folder '/proc' cannot be written"),
    "export gguf into a missing folder": (["export", "{lm}", "--gguf", "f32", "--out", "{files}/gone/m.gguf"],
                                          "folder '{files}/gone' does not exist"),
    "export merge under a file": (["export", "{lora}", "--merge", "--out", "{files}/records.jsonl/merged"],
                                  "'{files}/records.jsonl' is a file, not a folder"),
    "score out under a file": (["score", "{model}", "--data", "{files}/records.jsonl", "--out",
                                "{files}/records.jsonl/scored.jsonl"], "'{files}/records.jsonl' is a file"),
    "generate at a negative temperature": (["generate", "{lm}", "--temperature", "-1"],
                                           "--temperature must be 0 (greedy) or a positive number (got -1)"),
    "plan config not UTF-8": (["plan", "{files}/latin1.yaml"], "line 2 is not UTF-8"),
    "plan instances not UTF-8": (["plan", "--instances-file", "{files}/latin1.json"], "line 1 is not UTF-8"),
    "plan model config a folder without one": (["plan", "--model-config", "{files}/a-folder"],
                                               "is not a config.json file or a folder holding one"),
    "k8s config not UTF-8": (["k8s", "{files}/latin1.yaml", *K8S], "line 2 is not UTF-8"),
    "k8s instances not UTF-8": (["k8s", *K8S, "--instances-file", "{files}/latin1.json"], "line 1 is not UTF-8"),
    "k8s output a file": (["k8s", *K8S, "--output", "{files}/records.jsonl"], "is a file; pass a folder"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_commands_files_are_refused_in_one_line_before_work(case, files, reward_model, tiny_model_dir, lora_model,
                                                              tmp_path):
    args, expected = CASES[case]
    fill = {"files": files, "model": reward_model, "lm": tiny_model_dir, "lora": lora_model}
    proc = run_cli_here(*(a.format(**fill) for a in args), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("cputrain: error:")]
    assert errors == proc.stderr.strip().splitlines()[-1:], proc.stderr[-3000:]  # one line, the last word
    assert expected.format(**fill) in errors[0], errors[0]
    assert list(files.glob("**/*.tmp")) == [] and not (files / "gone").exists()


def test_a_refused_score_leaves_no_file_and_no_temporary_one(reward_model, tmp_path):
    """A record refused after the first batch was scored: neither the output nor a temporary file."""
    data = tmp_path / "records.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n' * 3 + '{"question": "no field to score"}\n')
    out = tmp_path / "scored.jsonl"
    proc = run_cli_here("score", reward_model, "--data", data, "--out", out, "--batch-size", 1)
    assert proc.returncode == 2 and "record 4 has no field to score" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["records.jsonl"]


def test_a_refused_preparation_leaves_no_partial_entry_to_resume(tmp_path, tiny_model_dir):
    """A record refused while tokenizing: the next run starts afresh, not "resuming an interrupted
    preparation" from an empty packed/<key>.partial/."""
    data = tmp_path / "feedback.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i} ", "completion": f"answer {i}", "label": "good"}) + "\n"
                            for i in range(20)))
    args = ["prepare", *tiny_overrides(tmp_path / "run", tmp_path / "cache", **{
        "model.name_or_path": tiny_model_dir, "data.source": data, "data.format": "feedback",
        "train.objective": "kto", "data.num_proc": 1, "data.max_documents": "null"})]
    for _ in range(2):
        proc = run_cli_here(*args)
        assert proc.returncode == 2 and "field 'label' must be true" in proc.stderr, proc.stderr[-3000:]
        assert "resuming" not in proc.stderr
        assert list((tmp_path / "cache" / "packed").glob("*")) == []


def test_score_nulls_a_record_past_the_models_positions_and_says_so(reward_model, tmp_path):
    """The tiny Llama has 256 positions: a longer record's score would mean nothing."""
    data = tmp_path / "records.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" +
                    json.dumps({"prompt": "a", "completion": " word" * 400}) + "\n")
    proc = run_cli_here("score", reward_model, "--data", data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [json.loads(line)["reward"] for line in proc.stdout.splitlines()]
    assert isinstance(rewards[0], float) and rewards[1] is None
    assert "1 record(s) of records.jsonl are longer than the model's 256 positions and were scored null (lines 2)" \
        in proc.stderr


def test_score_batches_a_classifier_saved_without_a_pad_token(reward_model, tmp_path):
    """transformers pools a batch of two only with config.pad_token_id: the tokenizer's is used."""
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(reward_model).pad_token_id is None
    data = tmp_path / "records.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" +
                    json.dumps({"prompt": "a", "completion": "a longer answer"}) + "\n")
    one_by_one = run_cli_here("score", reward_model, "--data", data, "--batch-size", 1)
    together = run_cli_here("score", reward_model, "--data", data, "--batch-size", 2)
    assert together.returncode == 0 and "Traceback" not in together.stderr, together.stderr[-3000:]
    for a, b in zip(one_by_one.stdout.splitlines(), together.stdout.splitlines(), strict=True):
        assert json.loads(a)["reward"] == pytest.approx(json.loads(b)["reward"], abs=1e-5)


def test_a_byte_order_mark_is_read_past_by_score_and_by_data_format_auto(reward_model, tmp_path):
    """Editors on Windows start UTF-8 files with a byte-order mark: score read its first line as no
    JSON, and data.format=auto read no fields there and chose text (then refused: no 'text' field)."""
    from cputrain.config import DataConfig
    from cputrain.data.sources import format_choice

    data = tmp_path / "records.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a", "completion": "b"}\n' * 3)
    proc = run_cli_here("score", reward_model, "--data", data)
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 3, proc.stderr[-3000:]
    assert format_choice(DataConfig(source=str(data), format="auto"))[0] == "prompt_completion"
