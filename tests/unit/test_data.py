"""Data: sources, packing without padding, the seeded order, the tokenizer and token caches."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from cputrain.config import DataConfig, ModelConfig
from cputrain.data import cache_builder, cache_key, cache_lock, order, prepare, sources, tokenizer as tokenizers
from cputrain.data.rows import Rows
from cputrain.data.text.kind import TextKind
from cputrain.data.validation_split import validation_mask
from cputrain.errors import DataError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    docs = sources._pydoc_documents()[:300]
    return tokenizers.train_bpe(docs, 400, tmp_path_factory.mktemp("tok") / "bpe")


# --- packing -----------------------------------------------------------------------------


def _pack(tmp_path, docs, tok, seq_len, val_fraction=0.1, seed=0, num_proc=1, **data):
    """Pack `docs` the way a run does: a .jsonl corpus, the token cache under tmp_path."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    corpus = tmp_path / f"corpus-{abs(hash(tuple(docs)))}.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"), seq_len=seq_len,
                     val_fraction=val_fraction, **data)
    return prepare.cached_data(cfg, sources.fingerprint(cfg), seed, TextKind(tok), num_proc)


def test_pack_has_no_padding_and_eos_between_documents(tok, tmp_path):
    docs = [f"document number {i} " + "word " * (i % 17) for i in range(60)]
    data = _pack(tmp_path, docs, tok, seq_len=16, val_fraction=0.1, seed=3)
    eos = tok.eos_token_id
    assert data.train.shape[1] == 16 and data.val.shape[1] == 16
    assert isinstance(data.rows("train"), Rows) and len(data.rows("val")) == len(data.val)
    assert data.stats["padding_tokens"] == 0
    assert not np.isin(tok.pad_token_id, data.train)  # packing never pads
    # Every token is accounted for: packed + dropped tail = documents + one EOS each.
    packed_tokens = data.train.size + data.val.size
    assert packed_tokens + data.stats["dropped_tail_tokens"] == data.stats["tokens"]
    encoded = tok([d.strip() for d in docs], add_special_tokens=False)["input_ids"]  # documents are stripped
    assert data.stats["tokens"] == sum(len(e) + 1 for e in encoded)
    # The EOS count in the train stream is the number of train documents whose end was kept.
    n_eos = int((np.asarray(data.train) == eos).sum())
    assert data.stats["documents"] - data.stats["val_documents"] - 1 <= n_eos <= data.stats["documents"] - data.stats["val_documents"]
    # The train stream is the train documents in corpus order, each followed by EOS.
    held = set(np.flatnonzero(validation_mask(60, 0.1, 3)[0]).tolist())
    expected = [t for i, e in enumerate(encoded) if i not in held for t in e + [eos]]
    assert np.asarray(data.train).reshape(-1).tolist() == expected[: data.train.size]


def test_records_whose_text_is_not_a_string_are_counted_not_dropped_silently(tok, tmp_path, caplog):
    good = [{"text": f"document {i} " + "word " * 20} for i in range(30)]
    odd = [{"text": 5}, {"text": None}, {"text": ["a", "list"]}, {"id": 7}, {"text": "   "}]
    corpus = tmp_path / "mixed.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in good[:3] + odd + good[3:]))
    cfg = DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"), seq_len=16, val_fraction=0.1)
    with caplog.at_level("WARNING", logger="cputrain"):
        data = prepare.cached_data(cfg, sources.fingerprint(cfg), 0, TextKind(tok), 1)
    assert data.stats["records"] == 35 and data.stats["documents"] == 30
    assert data.stats["skipped_not_text"] == 4 and data.stats["skipped_blank"] == 1
    assert any("4 record(s)" in r.message and "not text" in r.message for r in caplog.records)


def test_a_long_document_is_encoded_in_pieces_with_the_ids_of_the_whole(tok, tmp_path, monkeypatch):
    from cputrain.data.text import tokenize as tokenize_chunk

    doc = " ".join(f"word{i % 97}  and,more" for i in range(3000)) + " " + "x" * 5000 + " tail"
    parts = tokenize_chunk.pieces(doc, piece_chars=1000)
    assert "".join(parts) == doc and len(parts) > 20
    assert all(len(part) <= 1000 for part in parts[:-2])  # the run of x's has no space to cut at
    whole = _pack(tmp_path / "whole", [doc, "short one"], tok, seq_len=16, val_fraction=0.0)
    monkeypatch.setattr(tokenize_chunk, "PIECE_CHARS", 1000)
    cut = _pack(tmp_path / "cut", [doc, "short one"], tok, seq_len=16, val_fraction=0.0)
    assert np.array_equal(np.asarray(whole.train), np.asarray(cut.train))
    assert whole.stats["tokens"] == cut.stats["tokens"]


def test_validation_documents_are_held_out_whole(tok, tmp_path):
    docs = [f"unique{i:03d} " + "alpha beta gamma " * 3 for i in range(40)]
    data = _pack(tmp_path, docs, tok, seq_len=8, val_fraction=0.25, seed=0)
    assert data.stats["val_documents"] == 10
    assert "permutation" in data.stats["validation_rule"]  # by rule, not by list

    def stream(arr):
        return tok.decode(np.asarray(arr).reshape(-1).tolist())

    train_text, val_text = stream(data.train), stream(data.val)
    val_names, train_names = set(re.findall(r"unique\d{3}", val_text)), set(re.findall(r"unique\d{3}", train_text))
    assert len(val_names) >= 9  # the last document may lose its tail
    assert len(train_names) >= 29
    assert not val_names & train_names
    # The rule in stats.json names them: the held-out records are the seeded permutation's first ones.
    rule_ids = {f"unique{i:03d}" for i in np.flatnonzero(validation_mask(40, 0.25, 0)[0])}
    assert val_names <= rule_ids


def test_pack_is_deterministic_by_seed(tok, tmp_path):
    docs = [f"doc {i} text text" for i in range(50)]
    a = _pack(tmp_path / "a", docs, tok, 8, 0.2, seed=1)
    b = _pack(tmp_path / "b", docs, tok, 8, 0.2, seed=1)
    c = _pack(tmp_path / "c", docs, tok, 8, 0.2, seed=2)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert not np.array_equal(a.val, c.val)


def test_pack_is_the_same_for_any_number_of_processes(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(cache_builder, "CHUNK_CHARS", 2_000)  # many chunks, so the pool really splits the work
    docs = [f"record {i} " + "lorem ipsum dolor " * (i % 11) for i in range(1500)]
    one = _pack(tmp_path / "one", docs, tok, 16, 0.05, seed=4, num_proc=1)
    two = _pack(tmp_path / "two", docs, tok, 16, 0.05, seed=4, num_proc=2)
    assert two.stats["num_proc"] == 2
    assert np.array_equal(one.train, two.train) and np.array_equal(one.val, two.val)


def test_too_little_text_for_one_sequence(tok, tmp_path):
    with pytest.raises(DataError, match="fewer than one sequence"):
        _pack(tmp_path, ["tiny"], tok, seq_len=512, val_fraction=0.0)


def test_packed_cache_is_reused_and_complete(tok, tmp_path, monkeypatch):
    calls = []
    real_build = cache_builder.build
    monkeypatch.setattr(cache_builder, "build", lambda *a: calls.append(1) or real_build(*a))
    docs = [f"cached doc {i} " * 3 for i in range(30)]
    first = _pack(tmp_path, docs, tok, 8)
    second = _pack(tmp_path, docs, tok, 8)
    assert calls == [1]  # tokenized once
    assert np.array_equal(first.train, second.train) and first.stats == second.stats
    entries = sorted(p.name for p in (tmp_path / "cache" / "packed").iterdir())
    assert len(entries) == 1 and "." not in entries[0]  # no partial folder or lock left behind
    other = _pack(tmp_path, docs, tok, 4)
    assert calls == [1, 1] and other.seq_len == 4


# stats.json fields that describe the preparation run itself, not the data it produced
RUN_DEPENDENT = ("source", "resumed_at_record", "prepare_time_s", "tokens_per_s", "peak_memory_gib")


def test_interrupted_preparation_resumes_to_the_same_cache(tok, tmp_path, monkeypatch):
    from cputrain.data.text import tokenize as tokenize_chunk

    monkeypatch.setattr(cache_builder, "CHUNK_CHARS", 1_000)
    monkeypatch.setattr(cache_builder, "COMMIT_EVERY_S", 0.0)  # commit after every chunk
    docs = [f"line {i} " + "the quick brown fox " * (i % 7) for i in range(800)]
    clean = _pack(tmp_path / "clean", docs, tok, 16, 0.1)

    real = tokenize_chunk.tokenize_rows
    seen = []

    def killed_after_five(*args):
        if len(seen) == 5:
            raise KeyboardInterrupt  # what a kill looks like from here: the loop stops mid-way
        seen.append(args[0])
        return real(*args)

    monkeypatch.setattr(tokenize_chunk, "tokenize_rows", killed_after_five)
    with pytest.raises(KeyboardInterrupt):
        _pack(tmp_path / "resumed", docs, tok, 16, 0.1)
    partial = next((tmp_path / "resumed" / "cache" / "packed").glob("*.partial"))
    progress = json.loads((partial / "progress.json").read_text())
    assert progress["rows_done"] > 0 and not (partial / "stats.json").exists()
    assert not any(p.suffix == "" for p in partial.parent.iterdir() if p.is_dir())  # never taken as complete
    # Bytes written after the last commit (a kill between write and commit) are cut off on resume.
    with open(partial / "train.bin", "ab") as f:
        f.write(b"\xff" * 64)
    monkeypatch.setattr(tokenize_chunk, "tokenize_rows", real)
    resumed = _pack(tmp_path / "resumed", docs, tok, 16, 0.1)
    assert resumed.stats["resumed_at_record"] == progress["rows_done"]
    assert np.array_equal(clean.train, resumed.train) and np.array_equal(clean.val, resumed.val)
    assert {k: v for k, v in resumed.stats.items() if k not in RUN_DEPENDENT} \
        == {k: v for k, v in clean.stats.items() if k not in RUN_DEPENDENT}


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


def test_a_step_never_takes_a_row_twice():
    """8 preference pairs packed into one row with a batch of 8 took that row 8 times a step
    (epoch 8.0 after step 1): a batch of more rows than the data holds is no order."""
    with pytest.raises(ValueError, match="takes rows twice"):
        order.BatchOrder(1, 8, seed=0)
    o = order.BatchOrder(8, 8, seed=0)
    assert all(len(set(o.step_indices(s).tolist())) == 8 for s in range(3))


def test_a_batch_of_more_rows_than_the_data_made_is_refused_saying_what_fits():
    from cputrain.config import TrainConfig
    from cputrain.errors import ConfigError

    train = TrainConfig(global_batch_size=8, micro_batch_size=4)
    with pytest.raises(ConfigError) as err:
        order.check_batch_fits(train, rows=1, world_size=1, pairs=8)
    assert str(err.value) == (
        "train.global_batch_size (8) is more than the training set: 1 row holding 8 preference pairs; a step would "
        "train the same rows several times over; set train.global_batch_size=1 and train.micro_batch_size=1, or set "
        "the batch in pairs, one a row, as TRL counts it: train.global_batch_pairs=8 with data.packing=false")
    # the largest batch of whole micro-batches on every rank
    with pytest.raises(ConfigError, match=r"6 rows; .* set train.global_batch_size=6 and train.micro_batch_size=3$"):
        order.check_batch_fits(train, rows=6, world_size=2)
    with pytest.raises(ConfigError, match=r"train on at most 1 rank\(s\), or on more data$"):
        order.check_batch_fits(train, rows=1, world_size=2)
    with pytest.raises(ConfigError, match=r"on more data, or set the batch in pairs, .*: train.global_batch_pairs=8 with"):
        order.check_batch_fits(train, rows=1, world_size=2, pairs=8)  # unpacked, 8 rows: 4 a rank
    # set in pairs, the same rule speaks of pairs
    pairs = TrainConfig(global_batch_pairs=8, micro_batch_size=2, objective="dpo")
    with pytest.raises(ConfigError, match=r"^train.global_batch_pairs \(8\) is more than the training set: 5 rows "
                                          r"holding 5 preference pairs; .* set train.global_batch_pairs=4$"):
        order.check_batch_fits(pairs.model_copy(update={"global_batch_size": 8}), rows=5, world_size=1, pairs=5)
    order.check_batch_fits(train, rows=8, world_size=1, pairs=20)  # fits: each row once a step


def test_a_step_says_the_pairs_it_holds():
    from cputrain.config import TrainConfig

    assert order.pairs_per_step(TrainConfig(global_batch_size=8), rows=40, pairs=40) == \
        "8 preference pairs a step, one a row"
    assert order.pairs_per_step(TrainConfig(global_batch_size=8), rows=40, pairs=100).startswith(
        "8 rows a step, about 20 preference pairs (2.5 a packed row")


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
        (lambda p: _file(p / "bad.jsonl", '{"text": "fine"}\n{not json\n'), r"1 of 2 lines .* line 2"),
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
    data_cfg = DataConfig(cache_dir=str(tmp_path), max_documents=100)
    model_cfg = ModelConfig(tokenizer_vocab_size=300)
    calls = []

    def corpus():
        calls.append(1)
        return sources.open_corpus(data_cfg)

    first = tokenizers.get_tokenizer(model_cfg, data_cfg, "fp1", corpus)
    second = tokenizers.get_tokenizer(model_cfg, data_cfg, "fp1", corpus)
    assert calls == [1]  # trained once; the second run reads the cache
    assert len(first) == len(second) == 300
    assert first.eos_token == tokenizers.EOS and first.eos_token_id is not None
    assert cache_key.tokenizer_hash(first) == cache_key.tokenizer_hash(second)
    text = "def f(x):\n    return x ** 2  # ünïcödé"
    assert second.decode(second(text)["input_ids"]) == text  # byte-level: any text round-trips
    assert sorted(p.name for p in (tmp_path / "tokenizers").iterdir()) == ["bpe-v2-300-fp1-256mb"]  # no lock left


def test_tokenizer_sample_is_bounded_and_spread_over_the_corpus(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"record{i:05d} " + "x" * 90}) + "\n" for i in range(20_000)))
    corpus = sources.open_corpus(DataConfig(source=str(path), cache_dir=str(tmp_path / "cache")))
    sample = tokenizers.CorpusSample(corpus, max_chars=50_000)  # 2.5% of the corpus's 2 MB
    docs = list(sample)
    assert sample.chars <= 50_000 and sample.documents == len(docs) and 400 <= len(docs) <= 500
    ids = sorted(int(d[6:11]) for d in docs)
    assert ids[0] < 200 and ids[-1] > 19_000  # blocks from the start to the end, not the first 500 records
    whole = tokenizers.CorpusSample(corpus, max_chars=10**9)
    assert len(list(whole)) == 20_000  # a budget larger than the corpus reads all of it, in order


def test_one_huge_document_reaches_the_tokenizer_trainer_in_bounded_pieces(tmp_path):
    """A one-line file is one document. The BPE trainer pre-tokenizes every string it is given
    whole (a 52 MB line took `prepare` to 5.5 GB); the sample gives it pieces cut at whitespace,
    evenly spaced through the document when it is larger than the sample's budget."""
    words = [f"w{i:07d}" for i in range(400_000)]  # 3.2 MB on one line, each word findable
    path = tmp_path / "one-line.txt"
    path.write_text(" ".join(words))
    corpus = sources.open_corpus(DataConfig(source=str(path), cache_dir=str(tmp_path / "cache")))
    assert corpus.rows == 1
    budget = 640_000  # a fifth of the document
    sample = tokenizers.CorpusSample(corpus, max_chars=budget)
    pieces = list(sample)
    assert sample.documents == 1 and len(pieces) == budget // tokenizers.SAMPLE_PIECE_CHARS
    assert max(map(len, pieces)) <= tokenizers.SAMPLE_PIECE_CHARS * 1.02  # a cut moves to the nearest space
    assert sample.chars == sum(map(len, pieces)) <= budget * 1.02
    for piece in pieces:  # cut between words: every word in a piece is whole
        assert all(len(word) == 8 for word in piece.split())
    seen = sorted(int(word[1:]) for piece in pieces for word in piece.split())
    assert seen[0] < 10_000 and seen[-1] > 390_000 and 150_000 < seen[len(seen) // 2] < 250_000
    whole = tokenizers.CorpusSample(corpus, max_chars=10**9)
    assert "".join(whole) == path.read_text()  # within the budget: the whole document, in order


def test_prepare_spawns_a_builder_only_when_a_cache_is_missing(tok, tmp_path, monkeypatch):
    """A warm cache (a resumed run, every rank after the first) is opened in the calling process:
    no process that imports the data stack is started for nothing. A missing entry is still built
    in a spawned process, never in the caller."""
    from types import SimpleNamespace

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 9}) + "\n" for i in range(40)))
    cfg = SimpleNamespace(data=DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"), seq_len=16,
                                          num_proc=1),
                          model=ModelConfig(), seed=0)
    spawned = []

    def build_here(cfg, tokenizer, held_lock):  # stands for the spawned builder: builds here, counts the spawns
        spawned.append(cfg.seed)
        with cache_lock.built_for_parent(held_lock):
            prepare.prepare(cfg, tokenizer, isolate=False)

    monkeypatch.setattr(prepare, "_build_in_a_child", build_here)
    _, first = prepare.prepare(cfg, tok)
    assert spawned == [0]
    _, again = prepare.prepare(cfg, tok)
    assert len(spawned) == 1, "a warm cache started a builder process"
    assert np.array_equal(np.asarray(again.train), np.asarray(first.train))
    cfg.seed = 1  # another cut of the same data: a new entry, built in a spawned process again
    prepare.prepare(cfg, tok)
    assert spawned == [0, 1]


@pytest.mark.parametrize("tokenizer", ["given", "trained"])
def test_ranks_arriving_at_once_start_one_builder(tok, tmp_path, monkeypatch, tokenizer):
    """Every rank of a node finds the cache missing at the same moment. The first to look takes the
    entry's lock and keeps it while its builder runs; the others wait in their own process, not each
    in a builder of its own that would import the data stack only to wait. Where the tokenizer is
    trained first, they wait for the token cache that follows it too."""
    import multiprocessing
    import time
    from types import SimpleNamespace

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 9}) + "\n" for i in range(40)))
    cfg = SimpleNamespace(data=DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"), seq_len=16,
                                          num_proc=1),
                          model=ModelConfig(), seed=0)
    spawns = tmp_path / "spawns"

    def build_here(cfg, tokenizer, held_lock):  # the spawned builder's stand-in, slow to start as one is
        with spawns.open("a") as log:
            log.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        with cache_lock.built_for_parent(held_lock):
            prepare.prepare(cfg, tokenizer, isolate=False)

    def rank() -> None:
        _, data = prepare.prepare(cfg, tok if tokenizer == "given" else None)
        os._exit(0 if len(data.train) > 0 else 1)

    monkeypatch.setattr(prepare, "_build_in_a_child", build_here)
    monkeypatch.setattr(cache_lock, "POLL_S", 0.1)  # the waiting ranks look again sooner
    ranks = [multiprocessing.get_context("fork").Process(target=rank) for _ in range(3)]
    for proc in ranks:
        proc.start()
    for proc in ranks:
        proc.join(60)
    assert [proc.exitcode for proc in ranks] == [0, 0, 0]
    assert len(spawns.read_text().split()) == 1, "each rank started a builder of its own"
    assert not list((tmp_path / "cache" / "packed").glob("*.lock")), "a lock was left taken"


def test_auto_recognises_an_alpaca_file_and_input_may_be_missing(tok, tmp_path):
    """An Alpaca file as it is (instruction, input, output; `input` absent from every record here)
    is prepared as Alpaca records by data.format=auto, not read as text and refused."""
    from types import SimpleNamespace

    corpus = tmp_path / "alpaca.jsonl"
    corpus.write_text("".join(json.dumps({"instruction": f"Say {i}.", "output": f"{i} it is."}) + "\n"
                              for i in range(30)))
    data_cfg = DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache"), format="auto", seq_len=256,
                          num_proc=1, val_fraction=0.1)
    assert sources.record_format(data_cfg) == "alpaca"
    _, data = prepare.prepare(SimpleNamespace(data=data_cfg, model=ModelConfig(), seed=0), tok, isolate=False)
    assert data.stats["format"] == "alpaca" and data.stats["train_on"] == "completion"
    assert data.stats["train_examples"] + data.stats["val_examples"] == 30
    assert isinstance(data.rows("train"), Rows)  # the protocol every kind's rows satisfy


def test_a_resume_that_changes_what_is_trained_is_refused(tmp_path):
    """The documented rule: format, train_on, the template and the fields are part of a run's
    identity, as its data.source is; changing one is refused before any work."""
    from cputrain.config import Config
    from cputrain.errors import RunFolderError
    from cputrain.run_folder.layout import RunFolder
    from cputrain.run_folder.run_config import check_compatible, write_run_config

    run = RunFolder(str(tmp_path / "run"))
    old = Config.model_validate({"data": {"source": "c.jsonl", "format": "chat", "train_on": "assistant"}})
    write_run_config(run, old, [])
    run.fs.makedirs(run.step_path(4), exist_ok=True)
    run.write_text("{}", "checkpoints", "step-000004", "trainer_state.json")
    check_compatible(run, old)
    for key, value in (("train_on", "all"), ("chat_template", "t.jinja"), ("format", "auto"),
                       ("messages_field", "conversation")):
        changed = Config.model_validate({"data": {**old.data.model_dump(), key: value}})
        with pytest.raises(RunFolderError, match=f"holds checkpoints of another run \\(data.{key}: "):
            check_compatible(run, changed)
