"""Supervised fine-tuning through the real command: the loss of a step is the sum over trained
targets ÷ their number in the global batch (the same first step for 1 × 8, 8 × 1 and 2 ranks),
packing changes no loss, a stopped run resumes exactly, --chat answers, bad records are one line."""

from __future__ import annotations

import json

import pytest

from harness.run_cli import run_cli
from harness.tiny_run import sft_overrides, tiny_overrides

pytestmark = pytest.mark.slow


def _sft(out, cache_dir, chat_file, **extra):
    return tiny_overrides(out, cache_dir, **{**sft_overrides(chat_file), **extra})


def _rows(out) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_first_step_is_the_same_for_any_split_of_the_global_batch(tmp_path, cache_dir, chat_file):
    """Micro-batch 1 × accumulation 8, 8 × 1 and 2 ranks × 4: one loss and one gradient. Unpacked,
    micro-batches hold different numbers of trained tokens, so a mean of per-micro-batch means
    (the HF Trainer's rule before 4.46) would differ between them."""
    one = {"train.max_steps": 1, "train.global_batch_size": 8, "data.packing": "false", "train.eval_every": 100}
    runs = {
        "1x8": run_cli("train", *_sft(tmp_path / "a", cache_dir, chat_file, **one, **{"train.micro_batch_size": 1})),
        "8x1": run_cli("train", *_sft(tmp_path / "b", cache_dir, chat_file, **one, **{"train.micro_batch_size": 8})),
        "2 ranks": run_cli("train", "--nproc-per-node", "2",
                           *_sft(tmp_path / "c", cache_dir, chat_file, **one, **{"train.micro_batch_size": 4})),
    }
    for name, proc in runs.items():
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    firsts = {name: _rows(tmp_path / d)[1] for name, d in zip(runs, "abc")}
    ref = firsts["1x8"]
    for name, row in firsts.items():
        assert abs(row["loss"] - ref["loss"]) < 1e-5, (name, row["loss"], ref["loss"])
        assert abs(row["grad_norm"] - ref["grad_norm"]) < 1e-5 * max(1.0, ref["grad_norm"]), (name, row["grad_norm"])
    from safetensors.torch import load_file

    weights = [load_file(tmp_path / d / "model" / "model.safetensors") for d in "abc"]
    for other in weights[1:]:
        assert max(float((weights[0][k] - other[k]).abs().max()) for k in weights[0]) < 1e-5


def test_packing_changes_no_loss_and_a_stopped_run_resumes_exactly(tmp_path, cache_dir, chat_file):
    common = {"train.max_steps": 6, "train.eval_every": 3, "train.checkpoint_every": 3}
    straight, split = tmp_path / "straight", tmp_path / "split"
    proc = run_cli("train", *_sft(straight, cache_dir, chat_file, **common), check=True)
    assert "auto: data.format = chat" in proc.stderr and "trained" in proc.stderr
    run_cli("train", *_sft(split, cache_dir, chat_file, **common, **{"train.stop_at_step": 4}), check=True)
    run_cli("train", *_sft(split, cache_dir, chat_file, **common), check=True)
    a, b = _rows(straight), _rows(split)
    assert [a[s]["loss"] for s in range(1, 7)] == [b[s]["loss"] for s in range(1, 7)]
    assert a[6]["val_loss"] == b[6]["val_loss"] and a[6]["trained_tokens_per_s"] > 0
    assert a[6]["trained_tokens_per_s"] < a[6]["tokens_per_s"]  # prompts and padding carry no loss

    losses = {}
    for packing in ("true", "false"):
        # rows of 128 (the model's positions): several examples share a packed row
        proc = run_cli("eval", straight, *_sft(straight, cache_dir, chat_file, **{"data.packing": packing,
                                                                                  "data.seq_len": 128}), check=True)
        losses[packing] = json.loads(proc.stdout)
    assert losses["true"]["trained_targets"] == losses["false"]["trained_targets"] > 0
    assert losses["true"]["sequences"] < losses["false"]["sequences"]  # packed: fewer rows
    assert abs(losses["true"]["val_loss"] - losses["false"]["val_loss"]) < 1e-4

    # The exported model carries the chat template; --chat renders it and stops at the end of the turn.
    assert "<|im_start|>" in json.loads((straight / "model" / "tokenizer_config.json").read_text()).get(
        "chat_template", "") or (straight / "model" / "chat_template.jinja").is_file()
    reply = run_cli("generate", straight, "--chat", "What is assert?", "--max-new-tokens", "20", check=True)
    assert reply.stdout.strip() and "<|im_start|>" not in reply.stdout


@pytest.mark.parametrize("record, overrides, message", [
    ({"messages": [{"role": "robot", "content": "hi"}]}, {}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}, {},
     "an assistant turn is empty"),
    ({"prompt": ["a", "list"], "completion": "x"}, {"data.format": "prompt_completion"},
     "field 'prompt' must be a string"),
    ({"question": "hi"}, {"data.format": "chat"}, "record 2: field 'messages' must be a non-empty list"),
])
def test_bad_records_are_one_line_and_write_nothing(tmp_path, cache_dir, record, overrides, message):
    data = tmp_path / "bad.jsonl"
    good = {"prompt": "What is a list?", "completion": "A sequence."} if "prompt" in record else \
        {"messages": [{"role": "user", "content": "What is a list?"}, {"role": "assistant", "content": "A sequence."}]}
    data.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
    out = tmp_path / "run"
    proc = run_cli("train", *tiny_overrides(out, tmp_path / "cache", **{"data.source": data, "data.format": "auto",
                                                                         **overrides}))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() or not (out / "checkpoints").exists()


def test_chat_format_on_plain_text_is_refused(tmp_path, cache_dir):
    data = tmp_path / "plain.txt"
    data.write_text("some text\n")
    proc = run_cli("train", *tiny_overrides(tmp_path / "run", cache_dir, **{"data.source": data, "data.format": "chat"}))
    assert proc.returncode == 2 and "is plain text" in proc.stderr and "Traceback" not in proc.stderr
