"""Where documents come from: Python's own docs, local files, or a Hugging Face dataset.

Every source becomes a `datasets.Dataset` backed by Arrow files on disk (memory-mapped), so a
corpus of any size is read in batches and never held as Python strings. Local files and hub
datasets go through `datasets.load_dataset` (it converts .jsonl/.parquet/.txt to Arrow once and
caches it under data.cache_dir/datasets).
"""

from __future__ import annotations

import codecs
import errno
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cputrain.config import DataConfig
from cputrain.errors import DataError, first_line

log = logging.getLogger("cputrain")

BUILTIN_PREFIX = "builtin:"
HF_PREFIX = "hf:"
LOCAL_SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# errno values that mean "this disk is full", whichever layer (Arrow, numpy, Python) hit them.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class Corpus:
    """A source opened as Arrow: `dataset[i][field]` is document i; `rows` counts the records used."""

    dataset: object  # datasets.Dataset, memory-mapped
    field: str
    rows: int
    skipped_records: int = 0  # malformed .jsonl lines left out under data.bad_records=skip


def _pydoc_paragraphs():
    # The text behind Python's help(): ~465 kB of real English technical prose that ships with
    # every CPython, so the default run needs no download. Each paragraph is one document.
    from pydoc_data.topics import topics

    for name in sorted(topics):
        for p in topics[name].split("\n\n"):
            if len(p.strip()) > 40:
                yield {"text": p.strip()}


def _pydoc_instructions():
    # Instruction pairs from the same text, for the offline SFT demo (configs/demo-sft.yaml): each
    # help topic's title asked about, answered by its opening paragraph, then by its first two.
    from pydoc_data.topics import topics

    for name in sorted(topics):
        title, _, body = topics[name].strip().partition("\n")
        paragraphs = [" ".join(p.split()) for p in body.split("\n\n") if len(p.strip()) > 40 and "*" * 5 not in p]
        if not paragraphs:
            continue
        yield _chat(f"What is {title.strip()} in Python?", paragraphs[0])
        if len(paragraphs) > 1:
            yield _chat(f"Explain {title.strip()} in more detail.", " ".join(paragraphs[:2]))


def _pydoc_preferences():
    # Preference pairs from the same text, for the offline DPO demo (configs/demo-dpo.yaml): each
    # help topic's title asked about as builtin:pydoc-sft asks it, the chosen answer its own opening
    # paragraph, the rejected one the second paragraph of the next topic that has one (a fluent
    # answer to another question). No chosen text is ever another pair's rejected one: a model
    # cannot then pass held-out pairs by preferring paragraphs it was trained to prefer elsewhere.
    # Conversations, so a chat model (the SFT demo's) reads them as it was tuned.
    from pydoc_data.topics import topics

    topics_paragraphs = []
    for name in sorted(topics):
        title, _, body = topics[name].strip().partition("\n")
        paragraphs = [" ".join(p.split())[:300] for p in body.split("\n\n") if len(p.strip()) > 40 and "*" * 5 not in p]
        if paragraphs:
            topics_paragraphs.append((title.strip(), paragraphs))
    n = len(topics_paragraphs)
    for i, (title, paragraphs) in enumerate(topics_paragraphs):
        other = next((p[1] for _, p in (topics_paragraphs[(i + k) % n] for k in range(1, n)) if len(p) > 1), None)
        if other is not None and other != paragraphs[0]:
            yield {"prompt": [{"role": "user", "content": f"What is {title} in Python?"}],
                   "chosen": [{"role": "assistant", "content": paragraphs[0]}],
                   "rejected": [{"role": "assistant", "content": other}]}


def _pydoc_feedback():
    # Thumbs-up and thumbs-down answers from the same text, for the offline KTO demo
    # (configs/demo-kto.yaml): the pairs of builtin:pydoc-dpo taken apart as TRL's
    # unpair_preference_dataset takes them, every topic's chosen answer with a thumbs-up first, then
    # every topic's rejected one with a thumbs-down. No two neighbours share a question, so the
    # answer KTO's KL estimate takes from an example's neighbour is always another question's.
    pairs = list(_pydoc_preferences())
    for answer, label in (("chosen", True), ("rejected", False)):
        for pair in pairs:
            yield {"prompt": pair["prompt"], "completion": pair[answer], "label": label}


def _pydoc_garbled():
    # Preference pairs for the offline reward-model demo (configs/demo-reward.yaml): each help
    # topic's question as builtin:pydoc-dpo asks it, the chosen answer its opening paragraph, the
    # rejected one the same words in a shuffled order (seeded). What tells them apart is written
    # English, which a reward model can learn from ~70 pairs and carry to topics it never saw;
    # which of two fluent paragraphs answers the question (pydoc-dpo's pairs) it cannot, at the
    # demo's size (docs/guides/preference.md).
    import random

    rng = random.Random(0)
    for pair in _pydoc_preferences():
        words = pair["chosen"][0]["content"].split()
        rng.shuffle(words)
        yield {**pair, "rejected": [{"role": "assistant", "content": " ".join(words)}]}


def _pydoc_prompts():
    # Prompts alone for the offline online-RL demo (configs/demo-grpo.yaml): each help topic's
    # question as builtin:pydoc-dpo asks it, a conversation, with the topic's title in an `answer`
    # column for the reward functions (TRL hands such columns to them).
    from pydoc_data.topics import topics

    for name in sorted(topics):
        title = topics[name].strip().partition("\n")[0].strip()
        if title:
            yield {"prompt": [{"role": "user", "content": f"What is {title} in Python?"}], "answer": title}


def _chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


BUILTINS = {"builtin:pydoc": _pydoc_paragraphs, "builtin:pydoc-sft": _pydoc_instructions,
            "builtin:pydoc-dpo": _pydoc_preferences, "builtin:pydoc-kto": _pydoc_feedback,
            "builtin:pydoc-reward": _pydoc_garbled, "builtin:pydoc-grpo": _pydoc_prompts}


def _pydoc_documents() -> list[str]:
    return [row["text"] for row in _pydoc_paragraphs()]


def local_files(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"dataset '{source}' not found; give a .txt/.jsonl/.parquet file, a folder of them, or builtin:pydoc")
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")) if path.is_dir() else [path]
    if path.is_dir() and not any(p.suffix in LOCAL_SUFFIXES for p in files):
        raise DataError(f"folder '{source}' holds no .txt, .jsonl or .parquet files")
    others = sorted({p.suffix or p.name for p in files if p.suffix not in LOCAL_SUFFIXES})
    if others:
        where = f"folder '{source}' holds" if path.is_dir() else f"'{source}' is"
        raise DataError(f"{where} unsupported file type(s) {', '.join(others)}; use .txt, .jsonl or .parquet files only")
    kinds = {LOCAL_SUFFIXES[p.suffix] for p in files}
    if len(kinds) > 1:
        raise DataError(f"folder '{source}' mixes file types {sorted(kinds)}; keep one type per dataset")
    for p in files:
        if p.stat().st_size == 0:
            raise DataError(f"dataset file '{p}' is empty; point data.source at a file with text in it")
    return files


def fingerprint(cfg: DataConfig) -> str:
    """Changes when the data would: file names, sizes and times, or the hub id and split."""
    h = hashlib.sha256()
    h.update(f"{cfg.source}|{cfg.hf_config}|{cfg.hf_split}|{cfg.text_field}|{cfg.max_documents}|{cfg.bad_records}".encode())
    if not cfg.source.startswith((BUILTIN_PREFIX, HF_PREFIX)):
        for p in local_files(cfg.source):
            st = p.stat()
            h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    elif cfg.source in BUILTINS:
        import inspect
        import sys

        # Python's docs change with its version; the records made of them change with their code.
        h.update(sys.version.encode())
        h.update(inspect.getsource(BUILTINS[cfg.source]).encode())
    return h.hexdigest()[:16]


def no_text_error(source: str) -> DataError:
    return DataError(f"dataset '{source}' has no usable text (every record is empty or not a string)")


def disk_full_error(exc: OSError, where: str) -> DataError:
    return DataError(f"no space left on the disk of {where} ({os.strerror(exc.errno)}); free space there or set "
                     "data.cache_dir to a larger disk, then run again: the finished part is kept")


def _not_utf8(files: list[Path]) -> str | None:
    """'FILE at byte N' for the first file that is not UTF-8 text, else None (read in 1 MiB blocks)."""
    for p in files:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as err:
                    return f"'{p}' at byte {offset + err.start}"
                offset += len(block)
    return None


def _malformed_json_lines(files: list[Path]) -> tuple[int, int, str]:
    """(bad lines, all non-blank lines, where the first bad one is) over .jsonl files."""
    bad = total = 0
    first = ""
    for p in files:
        with open(p, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                total += 1
                try:
                    ok = isinstance(json.loads(line), dict)
                    why = "not a JSON object"
                except json.JSONDecodeError as err:
                    ok, why = False, err.msg
                if not ok:
                    bad += 1
                    first = first or f"{p.name} line {number}: {why}"
    return bad, total, first


def _good_json_records(files: list[str]):
    for name in files:
        with open(name, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict):
                    yield record


def _records_with_text(files: list[str], field: str):
    """{field: its string, or None where it is not one}, one per JSON object line."""
    for record in _good_json_records(files):
        value = record.get(field)
        yield {field: value if isinstance(value, str) else None}


def _load(cfg: DataConfig, cache: str):
    """The source as a datasets.Dataset, and how many malformed records were skipped."""
    import datasets

    if cfg.source.startswith(HF_PREFIX):
        return datasets.load_dataset(cfg.source[len(HF_PREFIX):], cfg.hf_config, split=cfg.hf_split, cache_dir=cache), 0
    files = local_files(cfg.source)
    kind = LOCAL_SUFFIXES[files[0].suffix]
    if kind == "text":
        bad = _not_utf8(files)  # one sequential read; the loader's own error would not say which byte
        if bad:
            raise DataError(f"dataset {bad} is not UTF-8 text (a binary file?); give text files, or convert it "
                            "(iconv -t UTF-8)")
    try:
        # A .txt file holds documents separated by blank lines (paragraphs, speeches, …).
        extra = {"sample_by": "paragraph"} if kind == "text" else {}
        return datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train", cache_dir=cache, **extra), 0
    except Exception as exc:
        if kind != "json":
            raise
        bad, total, first = _malformed_json_lines(files)
        if not bad and _text_field(cfg) == cfg.text_field and "changed from" in str(exc):
            # Every line is an object, but the text field holds a string in some and a number or
            # a list in others: Arrow wants one type per column. Read the lines here, give the
            # non-strings None, and tokenizing counts them (stats.json: skipped_not_text).
            return datasets.Dataset.from_generator(
                _records_with_text, gen_kwargs={"files": [str(p) for p in files], "field": cfg.text_field},
                cache_dir=cache), 0
        if not bad:
            raise
        if cfg.bad_records == "fail":
            raise DataError(f"{bad} of {total} lines of '{cfg.source}' are not JSON objects (first: {first}); fix them "
                            "or set data.bad_records=skip to leave them out") from None
        log.warning("data: skipping %d of %d lines of %s that are not JSON objects (first: %s)", bad, total,
                    cfg.source, first)
        return datasets.Dataset.from_generator(_good_json_records, gen_kwargs={"files": [str(p) for p in files]},
                                               cache_dir=cache), bad


def open_corpus(cfg: DataConfig, fields: tuple[str, ...] | None = None) -> Corpus:
    """The source as a memory-mapped Arrow dataset (converted once, cached under data.cache_dir).
    `fields`: the fields examples are read from (chat, prompt/completion); text reads one field."""
    import datasets

    datasets.disable_progress_bars()
    cache = os.path.join(cfg.cache_dir, "datasets")
    if cfg.source.startswith(BUILTIN_PREFIX) and cfg.source not in BUILTINS:
        raise DataError(f"unknown built-in dataset '{cfg.source}'; the built-in ones are {', '.join(BUILTINS)}")
    try:
        if cfg.source in BUILTINS:
            # datasets keys a generator's cache by its name, not its code: the fingerprint (the
            # Python version and the generator's code) makes a changed built-in a new dataset.
            ds, skipped = datasets.Dataset.from_generator(BUILTINS[cfg.source], cache_dir=cache,
                                                          fingerprint=fingerprint(cfg)), 0
        else:
            ds, skipped = _load(cfg, cache)
    except DataError:
        raise
    except OSError as exc:
        if exc.errno in DISK_FULL:
            raise disk_full_error(exc, f"data.cache_dir '{cfg.cache_dir}'") from None
        raise DataError(f"could not read dataset '{cfg.source}': {first_line(exc)}") from None
    except Exception as exc:  # the library's own message is the useful part
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OSError) and cause.errno in DISK_FULL:
            raise disk_full_error(cause, f"data.cache_dir '{cfg.cache_dir}'") from None
        raise DataError(f"could not read dataset '{cfg.source}': {first_line(exc)}") from None
    field = _text_field(cfg)
    for name in fields or (field,):
        if name not in ds.column_names:
            key = "data.text_field" if fields is None else "data.format and its field names (data.messages_field, " \
                "data.prompt_field, data.completion_field, data.chosen_field, data.rejected_field, data.label_field)"
            if fields is not None and name == cfg.margin_field:  # the one optional field: it can also be left out
                key = "data.margin_field to the field that holds each pair's margin, or data.margin_field=null"
            raise DataError(f"dataset '{cfg.source}' has no field '{name}' (fields: {ds.column_names}); set {key}")
    rows = min(len(ds), cfg.max_documents or len(ds))
    if rows == 0:
        raise DataError(f"dataset '{cfg.source}' has no records")
    return Corpus(ds, field if fields is None else fields[0], rows, skipped)


def _text_field(cfg: DataConfig) -> str:
    """The field a text corpus is read from; for chat and prompt/completion records the field whose
    text trains a tokenizer for a model built from scratch."""
    if cfg.source == "builtin:pydoc" or _plain_text_files(cfg):
        return "text"
    fmt = record_format(cfg)
    return {"chat": cfg.messages_field, "prompt_completion": cfg.prompt_field, "alpaca": "output",
            "preference": cfg.chosen_field, "feedback": cfg.completion_field, "prompt": cfg.prompt_field}.get(
        fmt, cfg.text_field)


def _plain_text_files(cfg: DataConfig) -> bool:
    return not cfg.source.startswith((BUILTIN_PREFIX, HF_PREFIX)) and \
        LOCAL_SUFFIXES[local_files(cfg.source)[0].suffix] == "text"


def first_record_fields(cfg: DataConfig) -> list[str]:
    """The field names of the first record, read without converting the corpus."""
    if cfg.source == "builtin:pydoc-sft":
        return ["messages"]
    if cfg.source in ("builtin:pydoc-dpo", "builtin:pydoc-reward"):
        return ["prompt", "chosen", "rejected"]
    if cfg.source == "builtin:pydoc-kto":
        return ["prompt", "completion", "label"]
    if cfg.source == "builtin:pydoc-grpo":
        return ["prompt", "answer"]
    if cfg.source.startswith(BUILTIN_PREFIX) or _plain_text_files(cfg):
        return ["text"]
    if cfg.source.startswith(HF_PREFIX):
        import datasets

        datasets.disable_progress_bars()
        return list(_load(cfg, os.path.join(cfg.cache_dir, "datasets"))[0].column_names)
    first = local_files(cfg.source)[0]
    if first.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_schema(first).names)
    with open(first, encoding="utf-8-sig", errors="replace") as f:  # -sig: a byte-order mark some editors write
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    return []
                return list(record) if isinstance(record, dict) else []
    return []


def record_format(cfg: DataConfig) -> str:
    """data.format: as set, or as auto decides it (a run's config has it decided: training.choices)."""
    return cfg.format if cfg.format != "auto" else format_choice(cfg)[0]


def format_choice(cfg: DataConfig) -> tuple[str, str]:
    """data.format=auto from the first record's fields, and why ("" when the config fixed it)."""
    if cfg.format != "auto":
        return cfg.format, ""
    fields = first_record_fields(cfg)
    if cfg.chosen_field in fields and cfg.rejected_field in fields:
        fmt, why = "preference", f"the first record has '{cfg.chosen_field}' and '{cfg.rejected_field}'"
    elif cfg.label_field in fields and cfg.completion_field in fields:
        fmt, why = "feedback", (f"the first record has '{cfg.completion_field}' and a '{cfg.label_field}' (TRL's "
                                "unpaired preference: a thumbs-up or down on one answer)")
    elif cfg.messages_field in fields:
        fmt, why = "chat", f"the first record has '{cfg.messages_field}'"
    elif cfg.prompt_field in fields and cfg.completion_field in fields:
        fmt, why = "prompt_completion", f"the first record has '{cfg.prompt_field}' and '{cfg.completion_field}'"
    elif "instruction" in fields and "output" in fields:
        fmt, why = "alpaca", "the first record has 'instruction' and 'output'"
    elif cfg.prompt_field in fields:
        fmt, why = "prompt", (f"the first record has '{cfg.prompt_field}' and no answer (TRL's prompt-only records, "
                              "for online RL)")
    else:
        fmt, why = "text", f"the first record has neither '{cfg.messages_field}' nor '{cfg.prompt_field}' + " \
                           f"'{cfg.completion_field}' nor Alpaca's 'instruction' + 'output'"
    return fmt, why


def clean(text) -> str | None:
    """A record's text as trained on: stripped; None for blanks and non-strings (they are left out).
    A conversation (a list of messages) reads as its messages' contents, for training a tokenizer."""
    if isinstance(text, list):
        from cputrain.data.chat_template import content_text

        contents = (content_text(m.get("content")) for m in text if isinstance(m, dict))
        text = "\n".join(c for c in contents if c)
    if not isinstance(text, str):
        return None
    return text.strip() or None


def iter_texts(corpus: Corpus, batch_rows: int = 1000, rows: range | None = None):
    """The corpus's documents in order, read in Arrow batches."""
    rows = rows if rows is not None else range(corpus.rows)
    for start in range(rows.start, rows.stop, batch_rows):
        for text in corpus.dataset[start : min(start + batch_rows, rows.stop)][corpus.field]:
            if (doc := clean(text)) is not None:
                yield doc


def read_documents(cfg: DataConfig) -> list[str]:
    """Every document as one list: for small corpora only (the benchmarks' peers take lists)."""
    docs = list(iter_texts(open_corpus(cfg)))
    if not docs:
        raise no_text_error(cfg.source)
    return docs
