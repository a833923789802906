"""Preference pairs: TRL's record forms become two sequences per pair with the answers trained,
what cannot be learnt from is counted or refused, and rows pack whole pairs with each token's
sequence."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cputrain.data import chat_template, sequences
from cputrain.data.batch import IGNORE_INDEX
from cputrain.data.preference import tokenize as tokenize_preferences
from cputrain.data.preference.rows import PairRows
from cputrain.data.preference.tokenize import PreferenceSpec, extract_prompt
from cputrain.errors import DataError


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from cputrain.data.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


class _Records:
    """What a worker reads of a datasets.Dataset: rows sliced into columns."""

    def __init__(self, records: list[dict]):
        self.records = records

    def __getitem__(self, rows: slice) -> dict:
        names = dict.fromkeys(name for record in self.records for name in record)
        return {name: [record.get(name) for record in self.records[rows]] for name in names}


def _tokenize(tok, records, seq_len=256, shared_prompt=False):
    template = chat_template.template_of(tok, None)
    spec = PreferenceSpec("prompt", "chosen", "rejected", template, chat_template.template_variables(tok), seq_len,
                          shared_prompt)
    sequences.init_worker(None, _Records(records), spec, tok.backend_tokenizer.to_str(), tok.eos_token_id, "uint16")
    return tokenize_preferences.tokenize_rows(0, len(records), np.zeros(len(records), bool))


def _sequences(chunk):
    ids, mask, lengths = chunk.parts["train.bin"], chunk.parts["train.mask.bin"], chunk.parts["train.lengths.bin"]
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(bounds, bounds[1:])]


def _trained_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_string_pairs_train_each_answer_and_eos_not_the_prompt(tok):
    chunk = _tokenize(tok, [{"prompt": "What is a list? ", "chosen": "A mutable sequence.", "rejected": "A number."}])
    (c_ids, c_mask), (r_ids, r_mask) = _sequences(chunk)
    assert chunk.counts["train_pairs"] == 1
    assert c_ids[-1] == r_ids[-1] == tok.eos_token_id and c_mask[-1] == r_mask[-1] == 1
    assert "A mutable sequence." in _trained_text(tok, c_ids, c_mask)
    assert "list" not in _trained_text(tok, c_ids, c_mask)
    assert _trained_text(tok, r_ids, r_mask).strip().startswith("A number")
    # the prompt's tokens are the same in both sequences, and untrained
    start = c_mask.index(1)
    assert c_ids[:start] == r_ids[:start] and not any(r_mask[:start])


def test_conversational_pairs_train_the_assistant_answer_only(tok):
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a tuple?"}]
    chunk = _tokenize(tok, [{"prompt": prompt, "chosen": [{"role": "assistant", "content": "An immutable sequence."}],
                             "rejected": [{"role": "assistant", "content": "A kind of fish."}]}])
    (c_ids, c_mask), (r_ids, r_mask) = _sequences(chunk)
    assert _trained_text(tok, c_ids, c_mask).strip().startswith("An immutable sequence.")
    assert _trained_text(tok, r_ids, r_mask).strip().startswith("A kind of fish.")
    assert "tuple" in tok.decode(c_ids) and "tuple" not in _trained_text(tok, c_ids, c_mask)


def test_the_implicit_prompt_is_the_shared_leading_messages(tok):
    user = {"role": "user", "content": "What is a dict?"}
    implicit = {"chosen": [user, {"role": "assistant", "content": "A mapping."}],
                "rejected": [user, {"role": "assistant", "content": "A list."}]}
    explicit = {"prompt": [user], "chosen": [{"role": "assistant", "content": "A mapping."}],
                "rejected": [{"role": "assistant", "content": "A list."}]}
    assert _sequences(_tokenize(tok, [implicit])) == _sequences(_tokenize(tok, [explicit]))
    # TRL's extract_prompt on texts: the space before the answers stays with them
    assert extract_prompt("Q: x? yes", "Q: x? no") == ("Q: x?", " yes", " no")


def test_identical_and_empty_answers_are_counted_long_pairs_dropped(tok):
    chunk = _tokenize(tok, [{"prompt": "Q ", "chosen": "same", "rejected": "same"},
                            {"prompt": "Q ", "chosen": "  ", "rejected": "no"},
                            {"prompt": "Q ", "chosen": "word " * 40, "rejected": "word " * 40 + "x"},
                            {"prompt": "Q ", "chosen": "yes", "rejected": "no"}], seq_len=60)
    c = chunk.counts
    assert (c["skipped_identical"], c["skipped_empty"], c["dropped_long"], c["train_pairs"]) == (1, 1, 1, 1)
    assert len(chunk.parts["train.lengths.bin"]) == 2  # one pair: two sequences


def test_a_pair_too_long_as_two_sequences_is_kept_where_the_shared_layout_fits(tok):
    record = {"prompt": "Explain this in one word: " + "word " * 40, "chosen": "yes", "rejected": "no"}
    whole = sum(len(ids) for ids, _ in _sequences(_tokenize(tok, [record])))
    seq_len = whole - 10  # the prompt's 40+ tokens laid out once fit; twice they do not
    unshared = _tokenize(tok, [record], seq_len, shared_prompt=False).counts
    assert (unshared["dropped_long"], unshared["train_pairs"]) == (1, 0)
    chunk = _tokenize(tok, [record], seq_len, shared_prompt=True)
    assert (chunk.counts["dropped_long"], chunk.counts["train_pairs"]) == (0, 1)
    # …and trained: one row of seq_len holds the pair, both answers' tokens are targets
    (c_ids, c_mask), (r_ids, r_mask) = _sequences(chunk)
    rows = PairRows(chunk.parts["train.bin"], chunk.parts["train.mask.bin"], chunk.parts["train.lengths.bin"],
                    seq_len, packing=True, pad_id=0, shared_prompt=True)
    batch = rows.batch([0])
    assert len(rows) == 1 and batch.input_ids.shape[1] == seq_len
    targets = batch.labels[0][batch.labels[0] != IGNORE_INDEX].tolist()
    assert targets == [i for i, m in zip(c_ids, c_mask) if m] + [i for i, m in zip(r_ids, r_mask) if m]
    # a shared cache is its own entry: its pairs differ from an unshared one's
    assert PreferenceSpec("p", "c", "r", None, {}, 64, True).key() != PreferenceSpec("p", "c", "r", None, {}, 64).key()


@pytest.mark.parametrize("record, message", [
    ({"prompt": "Q", "chosen": "yes"}, "field 'rejected' is missing"),
    ({"prompt": "Q", "chosen": "yes", "rejected": [{"role": "assistant", "content": "no"}]}, "both be strings"),
    ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
      "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "x"}]}, "prompts differ"),
])
def test_bad_records_are_one_line(tok, record, message):
    with pytest.raises(DataError, match=message) as err:
        _tokenize(tok, [record])
    assert "\n" not in str(err.value)


def test_rows_pack_whole_pairs_with_each_tokens_sequence():
    lengths = np.array([3, 4, 2, 2, 5, 5])  # pairs of 7, 4 and 10 tokens
    ids = np.arange(1, lengths.sum() + 1)
    mask = np.ones(lengths.sum(), dtype=np.uint8)
    rows = PairRows(ids, mask, lengths, seq_len=12, packing=True, pad_id=0)
    assert len(rows) == 2  # pairs 0 and 1 (11 tokens) in one row, pair 2 in the next
    batch = rows.batch([0, 1])
    assert batch.pairs == 3
    assert batch.sequence_ids[0].tolist() == [0] * 3 + [1] * 4 + [2] * 2 + [3] * 2 + [-1]
    assert batch.sequence_ids[1].tolist() == [4] * 5 + [5] * 5 + [-1] * 2
    assert batch.position_ids[0, :11].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1]
    firsts = torch.tensor([0, 3, 7, 9])  # no sequence's first token is a target
    assert (batch.labels[0, firsts] == IGNORE_INDEX).all() and batch.labels[0, 11] == IGNORE_INDEX
    unpacked = PairRows(ids, mask, lengths, seq_len=12, packing=False, pad_id=0).batch([2, 0])
    assert unpacked.input_ids.shape == (2, 10) and unpacked.sequence_ids[1].tolist() == [2] * 3 + [3] * 4 + [-1] * 3


def _margin_pairs(path, n=24):
    path.write_text("".join(json.dumps({"prompt": f"Question {i}?", "chosen": f" a good answer {i}",
                                        "rejected": f" bad {i}", "margin": float(i % 3)}) + "\n" for i in range(n)))
    return path


def test_a_reward_model_takes_trls_margin_column_by_its_name(tmp_path, tiny_model_dir, caplog):
    """A `margin` column in reward data is TRL's: taken where data.margin_field is unset (logged with
    its reason), left out with data.margin_field=null, and kept where it is set."""
    from cputrain.config.file import load_config
    from cputrain.training.objective_data_keys import objective_sets_data_keys

    data = _margin_pairs(tmp_path / "pairs.jsonl")
    # an output_dir of its own: the default, runs/default, is `make demo`'s, whose checkpoints (trained
    # without a margin) would make the run resume without one
    args = ["train.objective=reward", f"model.name_or_path={tiny_model_dir}", f"data.source={data}",
            f"output_dir={tmp_path / 'run'}"]
    with caplog.at_level("INFO", logger="cputrain"):
        assert objective_sets_data_keys(load_config(None, args)).data.margin_field == "margin"
    assert "auto: data.margin_field = margin (the records have TRL's 'margin' column" in caplog.text
    assert objective_sets_data_keys(load_config(None, [*args, "data.margin_field=null"])).data.margin_field is None
    assert objective_sets_data_keys(load_config(None, [*args, "data.margin_field=m2"])).data.margin_field == "m2"
    dpo = ["train.objective=dpo", f"data.source={data}"]  # no margin read: nothing taken
    assert objective_sets_data_keys(load_config(None, dpo)).data.margin_field is None


@pytest.mark.parametrize("objective", ["dpo", "simpo", "lm"])
def test_a_margin_field_where_no_loss_reads_it_is_refused(tmp_path, tiny_model_dir, objective):
    from harness.run_cli_here import run_cli_here
    from harness.tiny_run import tiny_overrides

    proc = run_cli_here("train", *tiny_overrides(tmp_path / "run", tmp_path / "cache", **{
        "train.objective": objective, "model.name_or_path": tiny_model_dir,
        "data.source": _margin_pairs(tmp_path / "pairs.jsonl"), "data.margin_field": "margin"}))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"data.margin_field=margin is read by a reward model's loss only (train.objective=reward; here " \
           f"{objective})" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


def test_a_margin_field_the_data_lacks_names_the_key_that_leaves_it_out(tmp_path):
    from cputrain.config import DataConfig
    from cputrain.data import sources

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Q{i}?", "chosen": " yes", "rejected": " no"}) + "\n"
                             for i in range(8)))
    data_cfg = DataConfig(source=str(pairs), format="preference", margin_field="margin", cache_dir=str(tmp_path))
    with pytest.raises(DataError) as err:
        sources.open_corpus(data_cfg, fields=("chosen", "rejected", "margin"))
    assert "has no field 'margin'" in str(err.value)
    assert "set data.margin_field to the field that holds each pair's margin, or data.margin_field=null" in \
        str(err.value)


def test_a_resumed_reward_run_that_trained_without_the_margin_keeps_it_out(tmp_path, tiny_model_dir, caplog):
    """A run folder whose checkpoints were trained with data.margin_field empty resumes so: taking the
    column now would make the folder's identity check refuse the run."""
    import yaml

    from cputrain.config.file import load_config
    from cputrain.training.objective_data_keys import objective_sets_data_keys

    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "step-000002" / "trainer_state.json").write_text("{}")
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"margin_field": None}}))
    args = ["train.objective=reward", f"output_dir={run}", f"data.source={_margin_pairs(tmp_path / 'p.jsonl')}"]
    with caplog.at_level("INFO", logger="cputrain"):
        assert objective_sets_data_keys(load_config(None, args)).data.margin_field is None
    assert "trained without a margin (config.yaml), and the run resumes so" in caplog.text
