"""Reward models through the CLI on a tiny model: a LoRA reward model on builtin:pydoc-dpo logs
TRL's figures (accuracy, margin, mean reward) and writes no sample; `cputrain eval` gives the
run's own validation figures; its model/ (adapters and head) loads in transformers as a sequence
classifier, and `cputrain score` scores the held-out pairs with the validation's accuracy; merged,
it is a plain classifier; a stopped and resumed run equals a straight one; full weights on two
sharded ranks (a head the files lack, filled after sharding) take one rank's first step; a reward
model on text, or under ZeRO-3, is refused before any work."""

from __future__ import annotations

import json

import pytest

from harness.run_cli import run_cli
from harness.run_cli_here import run_cli_here
from harness.run_metrics import metrics_rows
from harness.tiny_run import tiny_overrides

REWARD = {"data.format": "auto", "data.seq_len": 256, "data.val_fraction": 0.1,
          "data.max_documents": "null", "train.objective": "reward", "model.lora.enabled": "true",
          "model.lora.rank": 4, "train.lr": 1e-2, "train.max_steps": 6, "train.eval_every": 3,
          "train.checkpoint_every": 3, "train.eval_batches": 100}  # every held-out pair at each validation
KEYS = ("accuracy", "margin", "mean_reward")


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model()


@pytest.fixture(scope="module", autouse=True)
def pairs(tmp_path_factory) -> list[dict]:
    """builtin:pydoc-dpo's pairs with answers cut to 100 characters, so every pair fits data.seq_len
    (the held-out pairs are then exactly the run's validation pairs): the run's data.source."""
    from cputrain.data.sources import BUILTINS

    records = list(BUILTINS["builtin:pydoc-dpo"]())
    for pair in records:
        for answer in ("chosen", "rejected"):
            pair[answer][0]["content"] = pair[answer][0]["content"][:100]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    REWARD["data.source"] = str(path)
    return records


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir, base):
    out = tmp_path_factory.mktemp("reward") / "straight"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{"model.name_or_path": base, **REWARD,
                                                               "train.sample_tokens": 20}), check=True)
    assert "auto: model.chunked_loss = False (train.objective=reward" in proc.stderr, proc.stderr[-2000:]
    return out


def test_a_lora_reward_model_logs_trls_figures_and_writes_no_sample(straight):
    rows = metrics_rows(straight)
    assert all(key in r for r in rows if "loss" in r for key in KEYS)
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert rows[0]["loss"] != [r for r in rows if "loss" in r][-1]["loss"]
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["objective"] == "reward" and summary["lora"] is True
    assert summary["eval_accuracy"] == evals[-1]["eval_accuracy"] and summary["first_eval_accuracy"] == \
        evals[0]["eval_accuracy"]
    assert not (straight / "sample.txt").exists()  # a reward model writes no text
    config = json.loads((straight / "model" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]


def test_eval_gives_the_runs_own_validation_figures(straight):
    last = [r for r in metrics_rows(straight) if "eval_accuracy" in r][-1]
    result = json.loads(run_cli("eval", straight, "--max-sequences", 64, check=True).stdout)
    assert result["objective"] == "reward" and result["pairs"] > 0
    assert result["loss"] == pytest.approx(last["val_loss"], abs=1e-5)
    for key in KEYS:
        assert result[key] == pytest.approx(last[f"eval_{key}"], abs=1e-5), key


def _held_out(path, records, seed=1337) -> int:
    """The run's validation pairs (the validation rule on the data's records) as a .jsonl file."""
    from cputrain.data.validation_split import validation_mask

    held, n = validation_mask(len(records), REWARD["data.val_fraction"], seed)
    path.write_text("".join(json.dumps(r) + "\n" for r, h in zip(records, held) if h))
    return n


def test_the_model_loads_in_transformers_and_scores_held_out_pairs(tmp_path, straight, pairs):
    """`cputrain score` (the model as transformers loads it, pooled at each sequence's last token)
    on the held-out pairs: their accuracy is at least the run's last validation figure; transformers'
    own classifier (adapters and head on the base, num_labels=1) gives the same scores; merged, the
    model is a plain classifier with the same scores."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from cputrain.finished.score import accuracy_of

    held = tmp_path / "held.jsonl"
    held_pairs = _held_out(held, pairs)
    scored = tmp_path / "scored.jsonl"
    run_cli("score", straight, "--data", held, "--out", scored, check=True)
    rows = [json.loads(line) for line in scored.read_text().splitlines()]
    last = [r for r in metrics_rows(straight) if "eval_accuracy" in r][-1]
    assert len(rows) == held_pairs and accuracy_of(rows) >= last["eval_accuracy"] - 1e-9, (accuracy_of(rows), last)
    tok = AutoTokenizer.from_pretrained(straight / "model")
    model = AutoModelForSequenceClassification.from_pretrained(straight / "model", num_labels=1,
                                                               pad_token_id=tok.pad_token_id).eval()
    merged = tmp_path / "merged"
    run_cli("export", straight, "--merge", "--out", merged, check=True)
    plain = AutoModelForSequenceClassification.from_pretrained(merged).eval()  # its config says it all
    text = tok.apply_chat_template(rows[0]["prompt"] + rows[0]["chosen"], tokenize=False)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert float(model(input_ids=ids).logits[0, 0]) == pytest.approx(rows[0]["reward_chosen"], abs=1e-4)
        assert float(plain(input_ids=ids).logits[0, 0]) == pytest.approx(rows[0]["reward_chosen"], abs=1e-4)


def test_stop_and_resume_equals_the_straight_run(tmp_path, cache_dir, base, straight):
    split = tmp_path / "split"
    overrides = {"model.name_or_path": base, **REWARD}
    run_cli("train", *tiny_overrides(split, cache_dir, **overrides, **{"train.stop_at_step": 3}), check=True)
    resumed = run_cli("train", *tiny_overrides(split, cache_dir, **overrides), check=True)
    assert "resumed from" in resumed.stderr
    a = {r["step"]: r["loss"] for r in metrics_rows(straight) if "loss" in r}
    b = {r["step"]: r["loss"] for r in metrics_rows(split) if "loss" in r}
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert a[step] == pytest.approx(b[step], abs=1e-6), step


FULL = {"model.lora.enabled": "false", "train.lr": 1e-3, "train.max_steps": 1, "train.eval_every": 100}


def test_full_weights_on_two_sharded_ranks_take_one_ranks_first_step(tmp_path, cache_dir, base):
    """The head the causal LM's files lack is drawn from the seed and filled into what each rank
    holds once FSDP2 has sharded the model: two ranks' first step is the single rank's, and the
    exported folder is a plain sequence classifier."""
    one, two = tmp_path / "one", tmp_path / "fsdp"
    run_cli("train", *tiny_overrides(one, cache_dir, **{"model.name_or_path": base, **REWARD, **FULL}), check=True)
    run_cli("train", *tiny_overrides(two, cache_dir, **{"model.name_or_path": base, **REWARD, **FULL,
                                                        "parallel.strategy": "fsdp"}),
            "--nproc-per-node", "2", check=True)
    a, b = metrics_rows(one)[0], metrics_rows(two)[0]
    for key in ("loss", "grad_norm", *KEYS):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    config = json.loads((two / "model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["id2label"] == {"0": "LABEL_0"}


@pytest.mark.parametrize("extra, expect", [
    ({"data.source": "builtin:pydoc"}, "train.objective=reward trains on preference pairs, but data.format is text"),
    ({"parallel.strategy": "zero3"}, "parallel.strategy=zero3 does not train a reward model yet"),
])
def test_a_reward_model_it_cannot_train_is_refused_before_work(tmp_path, cache_dir, base, extra, expect):
    proc = run_cli_here("train", *tiny_overrides(tmp_path / "run", cache_dir, **{
        "model.name_or_path": base, **REWARD, "model.lora.enabled": "false", **extra}))
    assert proc.returncode == 2 and expect in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()
