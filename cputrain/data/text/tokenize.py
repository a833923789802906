"""What one tokenizing process does for text: documents [start, stop) → two flat token arrays.

Each worker reads the corpus itself (cputrain.data.worker_corpus) and returns the train and
validation streams of its rows as compact numpy arrays, EOS after each document. The parent only
appends them in order, so the result is the same for any number of workers. Imports stay light: a spawned worker needs no torch.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np

from cputrain.data.worker_corpus import WorkerCorpus

# Set once per process by `init_worker` (the pool's initializer, or the parent when it works alone).
_state: dict = {}


@dataclass
class ChunkTokens:
    start: int
    stop: int
    train: np.ndarray  # token ids of the train documents of these rows, EOS after each
    val: np.ndarray
    documents: int
    val_documents: int
    text_chars: int
    not_text: int = 0  # records whose text field is no string (a number, a list, missing): left out
    blank: int = 0  # records whose text is empty or whitespace: nothing to train on

    @property
    def parts(self) -> dict:
        """Stream file name → the tokens this chunk appends to it."""
        return {"train.bin": self.train, "val.bin": self.val}

    @property
    def counts(self) -> dict:
        return {"documents": self.documents, "val_documents": self.val_documents, "text_chars": self.text_chars,
                "not_text": self.not_text, "blank": self.blank}


def portable_tokenizer(tokenizer):
    """What a worker needs to rebuild the tokenizer: the fast tokenizer's JSON (no transformers
    import in the worker, ~150 MB less per process), or the object itself for a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return ("json", backend.to_str(), tokenizer.eos_token_id)
    return ("object", tokenizer, tokenizer.eos_token_id)


def init_worker(arrow_files: list[str] | None, dataset, field: str, tokenizer, dtype: str) -> None:
    """`tokenizer` as made by portable_tokenizer; `dataset` is used when `arrow_files` is None."""
    # One thread per process: the pool is the parallelism (Rust threads in every worker would
    # only fight over the same cores).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    kind, tok, eos = tokenizer
    if kind == "json":
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(tok)
        # encode_batch_fast skips the character offsets nobody here needs (~20% faster).
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)

        def ids_of(texts):
            return (e.ids for e in encode(texts, add_special_tokens=False))
    else:  # a slow (pure Python) tokenizer

        def ids_of(texts):
            return tok(texts, add_special_tokens=False)["input_ids"]

    _state.update(corpus=WorkerCorpus(arrow_files, dataset), field=field, ids_of=ids_of, eos=eos,
                  dtype=np.dtype(dtype))


# A document is encoded in pieces of at most this many characters, each cut before a space: the
# tokenizer's working memory grows with the text of one call (offsets and a string per token,
# ~100 bytes a character), and one document can be any length (a book on one line). A cut before
# a space is where the pre-tokenizer splits anyway, so the ids are those of the whole document.
PIECE_CHARS = 1_000_000


def pieces(doc: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """`doc` as consecutive pieces of at most `piece_chars` characters (longer only where no space
    falls in a piece's second half), cut before spaces; joined they are `doc`."""
    if len(doc) <= piece_chars:
        return [doc]
    out, start = [], 0
    while len(doc) - start > piece_chars:
        stop = doc.rfind(" ", start + piece_chars // 2, start + piece_chars)
        if stop <= start:  # no space: the next one, wherever it is (or the rest)
            stop = doc.find(" ", start + piece_chars)
            stop = len(doc) if stop < 0 else stop
        out.append(doc[start:stop])
        start = stop
    if start < len(doc):
        out.append(doc[start:])
    return out


def _stream(docs: list[str]) -> np.ndarray:
    s = _state
    if not docs:
        return np.empty(0, dtype=s["dtype"])
    eos = (s["eos"],)
    # Each document's ids, then EOS: the boundary the model learns to predict. No padding.
    if all(len(doc) <= PIECE_CHARS for doc in docs):
        flat = itertools.chain.from_iterable(itertools.chain(ids, eos) for ids in s["ids_of"](docs))
        return np.fromiter(flat, dtype=s["dtype"])
    parts = []
    for doc in docs:
        parts += [np.fromiter(ids, dtype=s["dtype"]) for piece in pieces(doc) for ids in s["ids_of"]([piece])]
        parts.append(np.asarray(eos, dtype=s["dtype"]))
    return np.concatenate(parts)


def tokenize_rows(start: int, stop: int, held_out: np.ndarray) -> ChunkTokens:
    """Rows [start, stop); held_out[i] says whether row start+i is a validation document."""
    from cputrain.data.sources import clean

    s = _state
    texts = s["corpus"][start:stop][s["field"]]
    train_docs, val_docs = [], []
    text_chars = not_text = blank = 0
    for text, is_val in zip(texts, held_out):
        doc = clean(text)
        if doc is None:
            if isinstance(text, str):
                blank += 1
            else:
                not_text += 1
            continue
        text_chars += len(doc)
        (val_docs if is_val else train_docs).append(doc)
    s["corpus"].read(text_chars)
    return ChunkTokens(start, stop, _stream(train_docs), _stream(val_docs), len(train_docs) + len(val_docs),
                       len(val_docs), text_chars, not_text, blank)
