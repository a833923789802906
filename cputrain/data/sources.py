"""Where documents come from: Python's own docs, local files, or a Hugging Face dataset.

Each source yields plain strings, one per document. Local files and hub datasets go through
the `datasets` library (it reads .jsonl/.parquet/.txt and caches them as Arrow).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from cputrain.config import DataConfig
from cputrain.errors import DataError

BUILTIN_PREFIX = "builtin:"
HF_PREFIX = "hf:"
LOCAL_SUFFIXES = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _pydoc_documents() -> list[str]:
    # The text behind Python's help(): ~465 kB of real English technical prose that ships with
    # every CPython, so the default run needs no download. Each paragraph is one document.
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        docs.extend(p.strip() for p in topics[name].split("\n\n") if len(p.strip()) > 40)
    return docs


def local_files(source: str) -> list[Path]:
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"dataset '{source}' not found; give a .txt/.jsonl/.parquet file, a folder of them, or builtin:pydoc")
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise DataError(f"folder '{source}' holds no .txt, .jsonl or .parquet files")
    kinds = {LOCAL_SUFFIXES.get(p.suffix) for p in files}
    if None in kinds:
        raise DataError(f"'{source}': unsupported file type; use .txt, .jsonl or .parquet")
    if len(kinds) > 1:
        raise DataError(f"folder '{source}' mixes file types {sorted(kinds)}; keep one type per dataset")
    for p in files:
        if p.stat().st_size == 0:
            raise DataError(f"dataset file '{p}' is empty; point data.source at a file with text in it")
    return files


def fingerprint(cfg: DataConfig) -> str:
    """Changes when the data would: file names, sizes and times, or the hub id and split."""
    h = hashlib.sha256()
    h.update(f"{cfg.source}|{cfg.hf_config}|{cfg.hf_split}|{cfg.text_field}|{cfg.max_documents}".encode())
    if not cfg.source.startswith((BUILTIN_PREFIX, HF_PREFIX)):
        for p in local_files(cfg.source):
            st = p.stat()
            h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    elif cfg.source == "builtin:pydoc":
        import sys

        h.update(sys.version.encode())
    return h.hexdigest()[:16]


def _from_datasets(cfg: DataConfig) -> Iterator[str]:
    import datasets

    datasets.disable_progress_bars()
    cache = os.path.join(cfg.cache_dir, "datasets")
    try:
        if cfg.source.startswith(HF_PREFIX):
            ds = datasets.load_dataset(cfg.source[len(HF_PREFIX):], cfg.hf_config, split=cfg.hf_split, cache_dir=cache)
        else:
            files = local_files(cfg.source)
            kind = LOCAL_SUFFIXES[files[0].suffix]
            # A .txt file holds documents separated by blank lines (paragraphs, speeches, …).
            extra = {"sample_by": "paragraph"} if kind == "text" else {}
            ds = datasets.load_dataset(kind, data_files=[str(p) for p in files], split="train", cache_dir=cache, **extra)
    except DataError:
        raise
    except Exception as exc:  # the library's own message is the useful part
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"could not read dataset '{cfg.source}': {first}") from None
    field = "text" if not cfg.source.startswith(HF_PREFIX) and files[0].suffix == ".txt" else cfg.text_field
    if field not in ds.column_names:
        raise DataError(f"dataset '{cfg.source}' has no field '{field}' (fields: {ds.column_names}); set data.text_field")
    for text in ds[field]:
        if isinstance(text, str):
            yield text


def read_documents(cfg: DataConfig) -> list[str]:
    if cfg.source.startswith(BUILTIN_PREFIX):
        if cfg.source != "builtin:pydoc":
            raise DataError(f"unknown built-in dataset '{cfg.source}'; the built-in one is builtin:pydoc")
        docs = _pydoc_documents()
    else:
        docs = [t.strip() for t in _from_datasets(cfg)]
    docs = [d for d in docs if d]
    if cfg.max_documents:
        docs = docs[: cfg.max_documents]
    if not docs:
        raise DataError(f"dataset '{cfg.source}' has no usable text (every record is empty or not a string)")
    return docs
