"""A tiny Llama saved as a Hugging Face folder, its tokenizer a BPE trained here.

No test reaches a model hub: a "pretrained" model is a LlamaConfig saved with save_pretrained,
and its tokenizer a BPE trained with `tokenizers` on Python's own documentation.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

_TOKENIZERS: dict[int, Path] = {}  # vocab size → a tokenizer trained once per process
_TOKENIZER_HOME = tempfile.TemporaryDirectory(prefix="cputrain-tests-tokenizers-")


def _train_tokenizer(folder: Path, vocab_size: int = 512):
    """The BPE of `vocab_size` tokens on Python's documentation, trained once per process and
    saved again at `folder`."""
    from transformers import AutoTokenizer

    from cputrain.data.sources import _pydoc_documents
    from cputrain.data.tokenizer import train_bpe

    if vocab_size not in _TOKENIZERS:
        _TOKENIZERS[vocab_size] = Path(_TOKENIZER_HOME.name) / str(vocab_size)
        train_bpe(_pydoc_documents()[:400], vocab_size, _TOKENIZERS[vocab_size])
    shutil.copytree(_TOKENIZERS[vocab_size], folder, dirs_exist_ok=True)
    return AutoTokenizer.from_pretrained(folder)


def make_tiny_model(folder: Path, vocab_size: int = 512, hidden: int = 64, layers: int = 2, seed: int = 0,
                    tie: bool = True, dtype=None) -> Path:
    """A Llama saved as a Hugging Face folder (config.json, model.safetensors, tokenizer), its
    weights in `dtype` (default fp32; Llama-3's published files are bf16)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(folder / "_tok", vocab_size)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(folder)  # safetensors by default
    tok.save_pretrained(folder)
    return folder


def shape_key(**shape) -> tuple:
    """What tells two tiny models apart: make_tiny_model's arguments with their defaults filled in,
    so tiny_model(hidden=64) is tiny_model()."""
    import inspect

    bound = inspect.signature(make_tiny_model).bind(None, **shape)
    bound.apply_defaults()
    return tuple((k, str(v)) for k, v in bound.arguments.items() if k != "folder")
