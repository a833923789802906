"""Supervised fine-tuning through the real command: the loss of a step is the sum over trained
targets ÷ their number in the global batch (the same first step for 1 × 8, 8 × 1 and 2 ranks),
packing changes no loss, a stopped run resumes exactly, --chat answers, the exported model/ chats in
transformers' pipeline and TRL's DPOTrainer takes it by its path, bad records are one line."""

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


COMMON = {"train.max_steps": 6, "train.eval_every": 3, "train.checkpoint_every": 3}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir, chat_file):
    """A chat fine-tuning run, straight through: compared with a stopped and resumed one, and its
    model/ taken where users take a fine-tuned model."""
    out = tmp_path_factory.mktemp("sft") / "straight"
    return out, run_cli("train", *_sft(out, cache_dir, chat_file, **COMMON), check=True)


def test_packing_changes_no_loss_and_a_stopped_run_resumes_exactly(tmp_path, cache_dir, chat_file, straight):
    (straight, proc), split = straight, tmp_path / "split"
    assert "auto: data.format = chat" in proc.stderr and "trained" in proc.stderr
    run_cli("train", *_sft(split, cache_dir, chat_file, **COMMON, **{"train.stop_at_step": 4}), check=True)
    run_cli("train", *_sft(split, cache_dir, chat_file, **COMMON), check=True)
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


def _ids(value) -> set[int]:
    return set(value) if isinstance(value, (list, tuple)) else {value}


def test_the_sft_export_answers_a_chat_in_a_transformers_pipeline(straight):
    """model/ of a chat run in transformers' pipeline, in this process: the chat template renders
    the message, and the generation config ends the reply at the end of the turn (<|im_end|>), as
    `cputrain generate --chat` does, not at LlamaConfig's default id (<|im_start|> here)."""
    from transformers import pipeline

    pipe = pipeline("text-generation", model=str(straight[0] / "model"))
    end_of_turn = pipe.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn in _ids(pipe.model.generation_config.eos_token_id)
    assert pipe.model.config.architectures == ["LlamaForCausalLM"]
    chat = pipe([{"role": "user", "content": "What is assert?"}], max_new_tokens=20, do_sample=False)
    reply = chat[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and "<|im_start|>" not in reply["content"]


def test_trl_s_dpo_trainer_takes_the_sft_export_by_its_path(straight, tmp_path):
    """TRL builds the model, and its DPO reference, from the class config.json names
    (`config.architectures[0]`): the SFT folder given as a path gets past construction."""
    pytest.importorskip("trl")
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    folder = str(straight[0] / "model")
    pair = {"prompt": [{"role": "user", "content": "What is a list?"}],
            "chosen": [{"role": "assistant", "content": "A mutable sequence."}],
            "rejected": [{"role": "assistant", "content": "A number."}]}
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False, max_length=None)
    trainer = DPOTrainer(model=folder, args=args, train_dataset=datasets.Dataset.from_list([pair, pair]),
                         processing_class=AutoTokenizer.from_pretrained(folder))
    assert type(trainer.model).__name__ == "LlamaForCausalLM" and trainer.ref_model is not None


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
