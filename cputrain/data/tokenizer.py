"""The tokenizer: the model folder's own, a given folder, or a byte-level BPE trained on the data.

A trained tokenizer is cached under data.cache_dir by the data's fingerprint, vocabulary size
and sample size, so only the first run pays for training it, and one process trains it while
the others wait (cache_lock). It is trained on a bounded sample of the corpus: evenly spaced
blocks of documents up to data.tokenizer_sample_mb, so its cost does not grow with the corpus,
given to the trainer in pieces, so its memory does not grow with the longest document.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from cputrain.data.chat_template import BUILTIN_TEMPLATE, IM_END, IM_START
from cputrain.errors import ModelError

log = logging.getLogger("cputrain")

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_bpe(documents: Iterable[str], vocab_size: int, folder: Path):
    """Train a byte-level BPE (GPT-2 style: any byte sequence encodes, no unknown tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # ChatML's turn markers too, so a model built from scratch can be fine-tuned on chat data
        # with the built-in template (cputrain.data.chat_template) without growing its vocabulary.
        special_tokens=[EOS, PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD,
                                   additional_special_tokens=[IM_START, IM_END])
    fast.chat_template = BUILTIN_TEMPLATE  # saved with it: transformers pipelines format chats the same way
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


SAMPLE_BLOCK_ROWS = 100  # documents read together: few Arrow slices, spread over the whole corpus
# The BPE trainer is given text in pieces of at most this many characters. It pre-tokenizes each
# string it is given whole, at tens of bytes per character: one 52 MB document (a one-line file)
# took the process to 5.5 GB. Pieces are cut before spaces (text.tokenize.pieces, which the token
# pass uses too), where the byte-level pre-tokenizer splits anyway: the words it counts are the same.
SAMPLE_PIECE_CHARS = 64_000


def document_pieces(doc: str, max_chars: int, piece_chars: int = SAMPLE_PIECE_CHARS) -> Iterator[str]:
    """`doc` in pieces of about `piece_chars`, at most about `max_chars` in all.

    A document longer than `max_chars` is sampled within itself: evenly spaced pieces, so a
    corpus that is one huge document gives the tokenizer its beginning, middle and end."""
    from cputrain.data.text.tokenize import pieces

    parts = pieces(doc, piece_chars)
    wanted = min(len(parts), max(1, max_chars // piece_chars))
    for i in np.unique(np.linspace(0, len(parts) - 1, wanted).astype(np.int64)):
        yield parts[int(i)]


class CorpusSample:
    """Evenly spaced blocks of documents, at most `max_chars` of text; counts what it gave."""

    def __init__(self, corpus, max_chars: int):
        from cputrain.data.sources import iter_texts

        self.corpus, self.max_chars, self.iter_texts = corpus, max_chars, iter_texts
        self.documents = self.chars = 0

    def __iter__(self) -> Iterator[str]:
        corpus = self.corpus
        head = list(self.iter_texts(corpus, rows=range(min(corpus.rows, 1000))))
        mean_chars = max(1.0, sum(map(len, head)) / max(1, len(head)))
        del head
        share = min(1.0, self.max_chars / (mean_chars * corpus.rows))  # of the corpus's blocks to read
        n_blocks = -(-corpus.rows // SAMPLE_BLOCK_ROWS)
        blocks = np.unique(np.linspace(0, n_blocks - 1, max(1, int(np.ceil(n_blocks * share)))).astype(np.int64))
        for block in blocks:
            start = int(block) * SAMPLE_BLOCK_ROWS
            for doc in self.iter_texts(corpus, rows=range(start, min(start + SAMPLE_BLOCK_ROWS, corpus.rows))):
                left_chars = self.max_chars - self.chars
                if self.chars and left_chars < min(len(doc), SAMPLE_PIECE_CHARS):
                    return
                self.documents += 1
                for piece in document_pieces(doc, left_chars):
                    self.chars += len(piece)
                    yield piece
                if len(doc) > left_chars:  # sampled within itself: the budget is spent
                    return


def get_tokenizer(model_cfg, data_cfg, fingerprint: str, corpus_fn):
    """The tokenizer for this run; `corpus_fn()` (the opened corpus) is called only if one must be trained."""
    if model_cfg.tokenizer:
        return load_tokenizer(model_cfg.tokenizer, model_cfg.trust_remote_code)
    if model_cfg.name_or_path:
        from cputrain.model import local_folder

        # The model folder is checked first, so a wrong path is reported as the model's.
        folder = local_folder(model_cfg.name_or_path)
        return load_tokenizer(str(folder), model_cfg.trust_remote_code)
    from cputrain.data.cache_lock import build_once

    sample_mb = data_cfg.tokenizer_sample_mb
    # v2: with ChatML's special tokens and template (a v1 tokenizer in the cache is not reused)
    folder = Path(data_cfg.cache_dir) / "tokenizers" / f"bpe-v2-{model_cfg.tokenizer_vocab_size}-{fingerprint}-{sample_mb:g}mb"

    def train() -> None:
        corpus = corpus_fn()
        sample = CorpusSample(corpus, int(sample_mb * 1e6))
        log.info("tokenizer: training a %d-token byte-level BPE on a sample of at most %g MB of %s (cached in %s)",
                 model_cfg.tokenizer_vocab_size, sample_mb, data_cfg.source, folder)
        train_bpe(sample, model_cfg.tokenizer_vocab_size, folder)
        if sample.documents == 0:
            shutil.rmtree(folder, ignore_errors=True)
            from cputrain.data.sources import no_text_error

            raise no_text_error(data_cfg.source)
        log.info("tokenizer: trained on %d documents, %.1f MB of text (%d records in the corpus)", sample.documents,
                 sample.chars / 1e6, corpus.rows)

    if not build_once(folder.with_name(folder.name + ".lock"), lambda: (folder / "tokenizer.json").exists(), train,
                      "training the tokenizer", data_cfg.lock_stale_s):
        log.info("tokenizer: cached BPE %s", folder)
    return load_tokenizer(str(folder))
