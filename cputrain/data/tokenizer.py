"""The tokenizer: the model folder's own, a given folder, or a byte-level BPE trained on the data.

A trained tokenizer is cached under data.cache_dir by the data's fingerprint and vocabulary
size, so only the first run pays for training it.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from cputrain.errors import ModelError

log = logging.getLogger("cputrain")

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_bpe(documents: list[str], vocab_size: int, folder: Path):
    """Train a byte-level BPE (GPT-2 style: any byte sequence encodes, no unknown tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD)
    # Written under a temporary name and renamed, so a killed run never leaves half a tokenizer.
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    fast.save_pretrained(tmp)
    try:
        os.rename(tmp, folder)
    except OSError:  # another process finished first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return fast


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str, trust_remote_code: bool = False, key: str = "model.tokenizer"):
    from transformers import AutoTokenizer

    # A local path gets a plain answer; otherwise transformers would report it as a bad hub id.
    local = Path(path).expanduser()
    if local.is_dir() and not any((local / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(f"'{path}' holds no tokenizer ({', '.join(TOKENIZER_FILES)}); set {key} to a tokenizer folder")
    if not local.exists() and (path.startswith((".", "/", "~")) or path.count("/") != 1):
        raise ModelError(f"tokenizer folder '{path}' not found; check {key}")
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"could not load a tokenizer from '{path}': {first}") from None
    if tok.eos_token_id is None:
        raise ModelError(f"tokenizer in '{path}' has no EOS token; documents cannot be separated when packing")
    return tok


def get_tokenizer(model_cfg, data_cfg, fingerprint: str, documents_fn):
    """The tokenizer for this run; `documents_fn()` is called only if one must be trained."""
    if model_cfg.tokenizer:
        return load_tokenizer(model_cfg.tokenizer, model_cfg.trust_remote_code)
    if model_cfg.name_or_path:
        from cputrain.model import local_folder

        # The model folder is checked first, so a wrong path is reported as the model's.
        folder = local_folder(model_cfg.name_or_path)
        return load_tokenizer(str(folder), model_cfg.trust_remote_code)
    folder = Path(data_cfg.cache_dir) / "tokenizers" / f"bpe-{model_cfg.tokenizer_vocab_size}-{fingerprint}"
    if (folder / "tokenizer.json").exists():
        log.info("tokenizer: cached BPE %s", folder)
        return load_tokenizer(str(folder))
    log.info("tokenizer: training a %d-token byte-level BPE on the data (cached in %s)", model_cfg.tokenizer_vocab_size, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    return train_bpe(documents_fn(), model_cfg.tokenizer_vocab_size, folder)
