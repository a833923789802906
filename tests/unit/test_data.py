"""Data: sources, packing without padding, the seeded order, the tokenizer and token caches."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from cputrain.config import DataConfig, ModelConfig
from cputrain.data import order, packing, sources, tokenizer as tokenizers
from cputrain.errors import DataError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    docs = sources._pydoc_documents()[:300]
    return tokenizers.train_bpe(docs, 400, tmp_path_factory.mktemp("tok") / "bpe")


# --- packing -----------------------------------------------------------------------------


def test_pack_has_no_padding_and_eos_between_documents(tok):
    docs = [f"document number {i} " + "word " * (i % 17) for i in range(60)]
    data = packing.pack_documents(docs, tok, seq_len=16, val_fraction=0.1, seed=3)
    eos = tok.eos_token_id
    assert data.train.shape[1] == 16 and data.val.shape[1] == 16
    assert data.stats["padding_tokens"] == 0
    assert not np.isin(tok.pad_token_id, data.train)  # packing never pads
    # Every token is accounted for: packed + dropped tail = documents + one EOS each.
    packed_tokens = data.train.size + data.val.size
    assert packed_tokens + data.stats["dropped_tail_tokens"] == data.stats["tokens"]
    encoded = tok(docs, add_special_tokens=False)["input_ids"]
    assert data.stats["tokens"] == sum(len(e) + 1 for e in encoded)
    # The EOS count in the train stream is the number of train documents whose end was kept.
    n_eos = int((data.train == eos).sum())
    assert data.stats["documents"] - data.stats["val_documents"] - 1 <= n_eos <= data.stats["documents"] - data.stats["val_documents"]


def test_validation_documents_are_held_out_whole(tok):
    docs = [f"unique{i:03d} " + "alpha beta gamma " * 3 for i in range(40)]
    data = packing.pack_documents(docs, tok, seq_len=8, val_fraction=0.25, seed=0)
    assert data.stats["val_documents"] == 10

    def stream(arr):
        return tok.decode(np.asarray(arr).reshape(-1).tolist())

    train_text, val_text = stream(data.train), stream(data.val)
    val_names, train_names = set(re.findall(r"unique\d{3}", val_text)), set(re.findall(r"unique\d{3}", train_text))
    assert len(val_names) >= 9  # the last document may lose its tail
    assert len(train_names) >= 29
    assert not val_names & train_names


def test_pack_is_deterministic_by_seed(tok):
    docs = [f"doc {i} text text" for i in range(50)]
    a = packing.pack_documents(docs, tok, 8, 0.2, seed=1)
    b = packing.pack_documents(docs, tok, 8, 0.2, seed=1)
    c = packing.pack_documents(docs, tok, 8, 0.2, seed=2)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert not np.array_equal(a.val, c.val)


def test_too_little_text_for_one_sequence(tok):
    with pytest.raises(DataError, match="fewer than one sequence"):
        packing.pack_documents(["tiny"], tok, seq_len=512, val_fraction=0.0, seed=0)


def test_packed_cache_is_reused_and_complete(tok, tmp_path):
    calls = []

    def docs():
        calls.append(1)
        return [f"cached doc {i} " * 3 for i in range(30)]

    key = {"data": "x", "tokenizer": packing.tokenizer_hash(tok), "seq_len": 8}
    first = packing.load_or_pack(str(tmp_path), key, docs, tok, 8, 0.1, 0)
    second = packing.load_or_pack(str(tmp_path), key, docs, tok, 8, 0.1, 0)
    assert calls == [1]  # tokenized once
    assert np.array_equal(first.train, second.train) and first.stats == second.stats
    folders = list((tmp_path / "packed").iterdir())
    assert len(folders) == 1 and not folders[0].name.count(".tmp")  # no temporary left behind
    other = packing.load_or_pack(str(tmp_path), {**key, "seq_len": 4}, docs, tok, 4, 0.1, 0)
    assert calls == [1, 1] and other.seq_len == 4


# --- order -------------------------------------------------------------------------------


def test_order_is_a_function_of_seed_and_step():
    a, b = order.BatchOrder(100, 8, seed=5), order.BatchOrder(100, 8, seed=5)
    assert all(np.array_equal(a.step_indices(s), b.step_indices(s)) for s in range(30))
    assert not np.array_equal(a.step_indices(0), order.BatchOrder(100, 8, seed=6).step_indices(0))


def test_each_epoch_visits_every_sequence_once():
    o = order.BatchOrder(40, 8, seed=0)
    first_epoch = np.concatenate([o.step_indices(s) for s in range(5)])
    assert sorted(first_epoch.tolist()) == list(range(40))
    second_epoch = np.concatenate([o.step_indices(s) for s in range(5, 10)])
    assert sorted(second_epoch.tolist()) == list(range(40))
    assert not np.array_equal(first_epoch, second_epoch)  # reshuffled per epoch


def test_ranks_split_the_same_global_batch():
    o = order.BatchOrder(1000, 16, seed=1)
    for world in (1, 2, 4):
        micro = 16 // world // 2
        shares = [np.concatenate(o.rank_micro_batches(7, r, world, micro)) for r in range(world)]
        assert np.array_equal(np.concatenate(shares), o.step_indices(7))
        assert all(len(m) == micro for r in range(world) for m in o.rank_micro_batches(7, r, world, micro))


# --- sources -----------------------------------------------------------------------------


def _write_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["First document about lists.", "Second one, about dicts.", "Third: tuples."]
    (tmp_path / "d.txt").write_text("\n\n".join(texts) + "\n")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
    return texts


@pytest.mark.parametrize("name, field", [("d.txt", "text"), ("d.jsonl", "body"), ("d.parquet", "text")])
def test_local_sources_read_documents(tmp_path, name, field):
    texts = _write_sources(tmp_path)
    cfg = DataConfig(source=str(tmp_path / name), text_field=field, cache_dir=str(tmp_path / "cache"))
    assert sources.read_documents(cfg) == texts


def test_builtin_pydoc_is_real_english():
    docs = sources.read_documents(DataConfig(source="builtin:pydoc"))
    assert len(docs) > 1000 and sum(map(len, docs)) > 300_000
    assert sum(" the " in d for d in docs) > len(docs) // 3


def test_max_documents_and_fingerprint(tmp_path):
    _write_sources(tmp_path)
    cfg = DataConfig(source=str(tmp_path / "d.txt"), max_documents=2, cache_dir=str(tmp_path / "c"))
    assert len(sources.read_documents(cfg)) == 2
    fp = sources.fingerprint(cfg)
    assert fp == sources.fingerprint(cfg)
    (tmp_path / "d.txt").write_text("changed text entirely\n")
    assert sources.fingerprint(cfg) != fp  # edited file: the caches keyed on it are not reused


def _file(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: p / "absent.txt", "not found"),
        (lambda p: _file(p / "e.txt", ""), "is empty"),
        (lambda p: _file(p / "b.txt", "\n\n   \n\n"), "no usable text"),
        (lambda p: _file(p / "n.jsonl", '{"text": ""}\n{"text": 5}\n'), "no usable text"),
        (lambda p: _file(p / "f.jsonl", '{"body": "x"}\n'), "no field 'text'"),
        (lambda p: _file(p / "x.csv", "a,b\n"), "unsupported file type"),
        (lambda p: _file(p / "bad.jsonl", "{not json\n"), "could not read dataset"),
        (lambda p: p, "holds no .txt"),
    ],
    ids=["missing", "empty", "blank", "no-strings", "no-field", "csv", "bad-json", "empty-folder"],
)
def test_bad_sources_raise_data_error(tmp_path, setup, message):
    folder = tmp_path / "data"
    folder.mkdir()
    path = setup(folder)
    with pytest.raises(DataError, match=message) as err:
        sources.read_documents(DataConfig(source=str(path), cache_dir=str(tmp_path / "cache")))
    assert "\n" not in str(err.value)


# --- tokenizer ---------------------------------------------------------------------------


def test_trained_tokenizer_is_cached(tmp_path):
    data_cfg = DataConfig(cache_dir=str(tmp_path))
    model_cfg = ModelConfig(tokenizer_vocab_size=300)
    calls = []

    def docs():
        calls.append(1)
        return sources._pydoc_documents()[:100]

    first = tokenizers.get_tokenizer(model_cfg, data_cfg, "fp1", docs)
    second = tokenizers.get_tokenizer(model_cfg, data_cfg, "fp1", docs)
    assert calls == [1]  # trained once; the second run reads the cache
    assert len(first) == len(second) == 300
    assert first.eos_token == tokenizers.EOS and first.eos_token_id is not None
    assert packing.tokenizer_hash(first) == packing.tokenizer_hash(second)
    text = "def f(x):\n    return x ** 2  # ünïcödé"
    assert second.decode(second(text)["input_ids"]) == text  # byte-level: any text round-trips
    assert [p.name for p in (tmp_path / "tokenizers").iterdir()] == ["bpe-300-fp1"]
