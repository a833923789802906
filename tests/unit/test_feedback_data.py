"""Unpaired feedback (data.format=feedback): TRL's record forms become one sequence each with the
answer trained and its label kept; auto finds the format; what cannot be learnt from is counted
or refused in one line; rows carry each example's label and its KL sequence (its prompt with its
neighbour's answer)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cputrain.config import DataConfig, ModelConfig
from cputrain.data import prepare, sources
from cputrain.data.batch import IGNORE_INDEX
from cputrain.errors import ConfigError, DataError
from harness.feedback_rows import FEEDBACK_RECORDS, chunk_sequences, feedback_rows, tokenize_feedback


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from cputrain.data.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def _trained(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_string_feedback_trains_the_answer_and_keeps_each_label(tok):
    chunk = tokenize_feedback(tok, [{"prompt": "What is a list? ", "completion": "A mutable sequence.", "label": True},
                            {"prompt": "What is a set? ", "completion": "A kind of fish.", "label": False},
                            {"prompt": "Q ", "completion": "  ", "label": True}])
    (ids, mask), (_, bad_mask) = chunk_sequences(chunk)
    assert ids[-1] == tok.eos_token_id and mask[-1] == 1 and "list" not in _trained(tok, ids, mask)
    assert _trained(tok, ids, mask).strip().startswith("A mutable sequence.")
    assert chunk.parts["train.labels.bin"].tolist() == [1, 0]
    assert (chunk.counts["desirable"], chunk.counts["undesirable"], chunk.counts["skipped_empty"]) == (1, 1, 1)


def test_conversations_train_the_answer_turns_with_or_without_a_prompt(tok):
    user = {"role": "user", "content": "What is a tuple?"}
    answer = {"role": "assistant", "content": "An immutable sequence."}
    chunk = tokenize_feedback(tok, [{"prompt": [user], "completion": [answer], "label": True},
                            {"completion": [user, answer], "label": False},  # the implicit prompt
                            {"completion": [answer, user], "label": True}])  # no closing answer: nothing to judge
    (a_ids, a_mask), (b_ids, b_mask) = chunk_sequences(chunk)
    assert (a_ids, a_mask) == (b_ids, b_mask)  # the same conversation either way
    assert _trained(tok, a_ids, a_mask).strip().startswith("An immutable sequence.")
    assert "tuple" in tok.decode(a_ids) and "tuple" not in _trained(tok, a_ids, a_mask)
    assert chunk.counts["no_answer"] == 1 and chunk.parts["train.labels.bin"].tolist() == [1, 0]


@pytest.mark.parametrize("label, expect", [(1, "must be true"), ("yes", "must be true"), (None, "is missing")])
def test_a_label_that_is_not_a_boolean_is_refused_naming_the_field(tok, label, expect):
    with pytest.raises(DataError) as err:
        tokenize_feedback(tok, [{"prompt": "Q ", "completion": "A.", "label": True},
                        {"prompt": "Q ", "completion": "B.", "label": label}])
    message = str(err.value)
    assert message.startswith(f"record 2: field 'label' {expect}") and "\n" not in message
    assert "data.label_field" in message


def _cfg(path, tmp_path, **extra):
    data_cfg = DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"), format="auto", seq_len=128,
                          num_proc=1, val_fraction=0.2, **extra)
    return SimpleNamespace(data=data_cfg, model=ModelConfig(), seed=0)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_auto_finds_feedback_and_stats_count_each_label(tok, tmp_path):
    records = [{"prompt": f"Q{i}: ", "completion": f"answer number {i}.", "label": i % 3 != 0} for i in range(30)]
    cfg = _cfg(_write(tmp_path / "fb.jsonl", records), tmp_path)
    assert sources.format_choice(cfg.data)[0] == "feedback"
    _, data = prepare.prepare(cfg, tok, isolate=False)
    s = data.stats
    assert s["format"] == "feedback" and s["train_examples"] + s["val_examples"] == 30
    assert s["desirable"] + s["undesirable"] == s["train_examples"]
    assert s["desirable"] + s["val_desirable"] == 20 and s["undesirable"] + s["val_undesirable"] == 10
    train = data.rows("train")
    assert int(train.labels.sum()) == s["desirable"] and "desirable" in data.describe()


def test_feedback_of_one_label_only_is_refused_in_one_line(tok, tmp_path):
    records = [{"prompt": f"Q{i}: ", "completion": f"answer {i}.", "label": True} for i in range(20)]
    from cputrain.data.feedback.kind import refuse_one_label

    cfg = _cfg(_write(tmp_path / "up.jsonl", records), tmp_path)
    _, data = prepare.prepare(cfg, tok, isolate=False)  # evaluation scores it (the check is training's)
    with pytest.raises(DataError) as err:
        refuse_one_label(data.stats, cfg.data)
    assert "label=true" in str(err.value) and "label=false" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("objective, data_format, expect", [
    ("kto", "preference", "train.objective=kto trains on answers each with a thumbs-up or down"),
    ("kto", "text", "set data.format=feedback"),
    ("reward", "text", "train.objective=reward trains on preference pairs"),
    ("lm", "feedback", "set train.objective=kto"),
])
def test_an_objective_on_data_it_cannot_read_is_refused(objective, data_format, expect):
    from cputrain.objectives.objective import objective_class

    with pytest.raises(ConfigError, match=expect):
        objective_class(objective).check_data(data_format)


@pytest.mark.parametrize("packing", [False, True])
def test_a_batch_carries_labels_and_each_examples_kl_sequence(tok, packing):
    rows, seqs = feedback_rows(tok, FEEDBACK_RECORDS, packing)
    batch = rows.batch(range(len(rows)))
    assert batch.examples == 5 and batch.desirable.tolist() == [True, False, True, False, True]
    assert (len(rows) < 5) == packing  # packed: several examples a row
    for e in range(5):
        ids, mask = seqs[e]
        start = mask.index(1)
        p_ids, p_mask = seqs[(e - 1) % 5]  # the neighbour before it, the first's the last's
        p_start = p_mask.index(1)
        kl = batch.kl.input_ids[batch.kl.sequence_ids == e].tolist()
        assert kl == ids[:start] + p_ids[p_start:], e
        targets = batch.kl.labels[batch.kl.sequence_ids == e]
        assert tok.decode(targets[targets != IGNORE_INDEX].tolist()) == tok.decode(p_ids[p_start:])
        matched = batch.input_ids[batch.sequence_ids == e].tolist()
        assert matched == ids
    # the reference's table rides along once computed: 2e the example, 2e+1 its KL sequence
    rows.reference_logps = torch.arange(10, dtype=torch.float32)
    batch = rows.batch([len(rows) - 1, 0])
    examples = [int(e) for r in (len(rows) - 1, 0) for e in range(rows.bounds[r], rows.bounds[r + 1])]
    assert batch.reference_logps.tolist() == [2.0 * e for e in examples]
    assert batch.kl.reference_logps.tolist() == [2.0 * e + 1 for e in examples]


def test_a_kl_sequence_is_cut_at_seq_len(tok):
    """A long prompt followed by its neighbour's long answer is cut as TRL's collator cuts it."""
    long = [{"prompt": "P " * 30, "completion": "short.", "label": True},
            {"prompt": "Q ", "completion": " word" * 30, "label": False}]
    _, seqs = feedback_rows(tok, long, packing=False)
    seq_len = max(len(ids) for ids, _ in seqs) + 1
    rows, _ = feedback_rows(tok, long, packing=False, seq_len=seq_len)
    kl_ids, kl_mask = rows.kl_sequence(0)  # the long prompt with the long answer
    assert len(kl_ids) == seq_len and kl_mask[-1] == 1


@pytest.mark.parametrize("spelled", ["every label a string", "some labels strings"])
def test_labels_spelled_as_strings_follow_one_rule(tok, tmp_path, spelled):
    """"true"/"false" are the booleans they spell, whether every label is a string or only some (the
    JSON reader turns them into booleans in a column it found boolean: refusing them would hold only
    where all are strings); other strings are refused."""
    def label(i):
        value = i % 3 != 0
        return str(value).lower() if spelled == "every label a string" or i % 4 == 0 else value

    records = [{"prompt": f"Q{i}: ", "completion": f"answer number {i}.", "label": label(i)} for i in range(30)]
    _, data = prepare.prepare(_cfg(_write(tmp_path / "fb.jsonl", records), tmp_path), tok, isolate=False)
    assert data.stats["desirable"] + data.stats["val_desirable"] == 20
    records[5]["label"] = "yes"
    with pytest.raises(DataError, match="record 6: field 'label' must be true"):
        prepare.prepare(_cfg(_write(tmp_path / "fb.jsonl", records), tmp_path / "again"), tok, isolate=False)


def test_kto_over_feedback_with_data_format_left_at_its_default_just_works(tmp_path, tiny_model_dir, caplog):
    """The objective says which format it trains on (its class's data_format): data.format left at
    its default (text) is decided from the records, as auto, and logged with its reason; a format
    the user set is kept (and refused where the objective cannot take it)."""
    from cputrain.config.file import load_config
    from cputrain.training.objective_data_keys import objective_sets_data_keys
    from harness.run_cli_here import run_cli_here
    from harness.tiny_run import tiny_overrides

    data = _write(tmp_path / "fb.jsonl", [{"prompt": f"Q{i}: ", "completion": f"answer number {i}.",
                                           "label": i % 3 != 0} for i in range(30)])
    with caplog.at_level("INFO", logger="cputrain"):
        cfg = objective_sets_data_keys(load_config(None, ["train.objective=kto", f"data.source={data}"]))
    assert cfg.data.format == "auto" and sources.format_choice(cfg.data)[0] == "feedback"
    assert "auto: data.format = auto (left at its default, text, but train.objective=kto trains on feedback" \
        in caplog.text
    assert objective_sets_data_keys(load_config(None, [f"data.source={data}"])).data.format == "text"  # lm: text
    proc = run_cli_here("train", *tiny_overrides(tmp_path / "run", tmp_path / "cache", **{
        "train.objective": "kto", "model.name_or_path": tiny_model_dir, "data.source": data,
        "data.format": "text"}))  # set: kept, and refused before work
    assert proc.returncode == 2 and "train.objective=kto trains on answers each with a thumbs-up or down" \
        in proc.stderr, proc.stderr[-3000:]
