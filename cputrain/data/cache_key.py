"""The key of a token cache entry, for every kind of data: packed/<key>/ is found again only by
a run whose data, tokenizer, cut and kind would write the same entry.

The key hashes what the data is (sources.fingerprint), the tokenizer, data.seq_len, the
validation cut and the seed; a kind other than text adds its part (DataKind.key: how its records
become sequences), stored under "examples" with the rule of which tokens an answer holds. A text
key has no such part, so text keys are what they were before there were other kinds. The strings
and their inputs are the keys of entries already on disk: changing either orphans every cache.
"""

from __future__ import annotations

import hashlib
import json

from cputrain.config import DataConfig
from cputrain.data.chat_template import ANSWER_MASK_RULE

# Bumped when the layout or the packing rule changes, so no older entry is read as a newer one.
CACHE_FORMAT = 2


def tokenizer_hash(tokenizer) -> str:
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16] if hasattr(
        tokenizer, "backend_tokenizer"
    ) else hashlib.sha256(repr(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]


def cache_key(data_fingerprint: str, data_cfg: DataConfig, seed: int, tokenizer, kind_part: dict | None = None) -> str:
    """The one key of a cache entry: what the data is, how it is tokenized, cut and split; for a
    kind other than text also its part (`kind_part`: for examples the format, fields, template,
    what is trained, truncation; for pairs their fields, template and layout)."""
    parts = {
        "format": CACHE_FORMAT,
        "data": data_fingerprint,
        "tokenizer": tokenizer_hash(tokenizer),
        "seq_len": data_cfg.seq_len,
        "val_fraction": data_cfg.val_fraction,
        "seed": seed,
    }
    if kind_part is not None:
        # a cache written under another rule for which tokens an answer holds is not reused
        parts["examples"] = {**kind_part, "answer_mask": ANSWER_MASK_RULE}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
