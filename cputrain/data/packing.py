"""Tokenize once, pack into fixed-length sequences with EOS between documents, cache on disk.

No padding: every token the model sees is a real one, so "useful tokens" = all tokens. The
cache is two .npy files (train, validation) of shape [n_sequences, seq_len], opened with
mmap so a large corpus is not read into every rank's memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cputrain.errors import DataError

log = logging.getLogger("cputrain")


@dataclass
class PackedData:
    train: np.ndarray  # [n_train, seq_len] token ids
    val: np.ndarray  # [n_val, seq_len]
    stats: dict  # documents, tokens, sequences, dropped tail tokens

    @property
    def seq_len(self) -> int:
        return self.train.shape[1]


def tokenizer_hash(tokenizer) -> str:
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16] if hasattr(
        tokenizer, "backend_tokenizer"
    ) else hashlib.sha256(repr(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]


def _pack(docs: list[list[int]], eos: int, seq_len: int) -> tuple[np.ndarray, int]:
    total = sum(len(d) + 1 for d in docs)
    flat = np.empty(total, dtype=np.int32)
    pos = 0
    for d in docs:
        flat[pos : pos + len(d)] = d
        flat[pos + len(d)] = eos  # the boundary the model learns to predict
        pos += len(d) + 1
    n = total // seq_len
    return flat[: n * seq_len].reshape(n, seq_len), total - n * seq_len


def pack_documents(documents: list[str], tokenizer, seq_len: int, val_fraction: float, seed: int) -> PackedData:
    encoded = tokenizer(documents, add_special_tokens=False)["input_ids"]
    order = np.random.default_rng(seed).permutation(len(documents))
    n_val = int(round(len(documents) * val_fraction))
    if val_fraction > 0 and len(documents) > 1:
        n_val = max(1, n_val)
    val_ids, train_ids = set(order[:n_val].tolist()), order[n_val:]
    # Validation documents are whole documents never seen in training.
    train, dropped_train = _pack([encoded[i] for i in train_ids], tokenizer.eos_token_id, seq_len)
    val, dropped_val = _pack([encoded[i] for i in sorted(val_ids)], tokenizer.eos_token_id, seq_len)
    tokens = sum(len(e) + 1 for e in encoded)
    if len(train) == 0:
        raise DataError(
            f"the training split has {tokens} tokens, fewer than one sequence of data.seq_len={seq_len}; "
            "use more text or a shorter data.seq_len"
        )
    stats = {
        "documents": len(documents),
        "val_documents": n_val,
        "tokens": tokens,
        "train_sequences": int(len(train)),
        "val_sequences": int(len(val)),
        "seq_len": seq_len,
        "dropped_tail_tokens": dropped_train + dropped_val,
        "padding_tokens": 0,
    }
    return PackedData(train, val, stats)


def load_or_pack(cache_dir: str, key_parts: dict, documents_fn, tokenizer, seq_len, val_fraction, seed) -> PackedData:
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / "packed" / key
    if (folder / "stats.json").exists():
        stats = json.loads((folder / "stats.json").read_text())
        log.info("data: cached packed tokens %s", folder)
        return PackedData(
            np.load(folder / "train.npy", mmap_mode="r"), np.load(folder / "val.npy", mmap_mode="r"), stats
        )
    packed = pack_documents(documents_fn(), tokenizer, seq_len, val_fraction, seed)
    tmp = folder.with_name(f"{key}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "train.npy", packed.train)
    np.save(tmp / "val.npy", packed.val)
    (tmp / "stats.json").write_text(json.dumps(packed.stats, indent=1))  # written last: marks it complete
    try:
        os.rename(tmp, folder)
    except OSError:  # another rank or run got there first with the same content
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return packed
