"""Shared fixtures: tiny models built from a config, tokenizers trained here, the CLI as a subprocess.

No test reaches a model hub: a "pretrained" model is a LlamaConfig saved with save_pretrained,
and its tokenizer a BPE trained with `tokenizers` on Python's own documentation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# The smallest model that still has every part of a Llama (GQA, RoPE, SwiGLU, tied embeddings).
TINY_ARCH = [
    "model.arch.model_type=llama",
    "model.arch.hidden_size=64",
    "model.arch.intermediate_size=128",
    "model.arch.num_hidden_layers=2",
    "model.arch.num_attention_heads=4",
    "model.arch.num_key_value_heads=2",
    "model.arch.max_position_embeddings=128",
    "model.arch.tie_word_embeddings=true",
    "model.tokenizer_vocab_size=512",
]


def tiny_overrides(out_dir, cache_dir, **extra) -> list[str]:
    """key=value overrides for a run that takes seconds: tiny model, short sequences, few docs."""
    base = {
        "output_dir": str(out_dir),
        "data.cache_dir": str(cache_dir),
        "data.seq_len": 32,
        "data.max_documents": 400,
        "train.max_steps": 10,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 4,
        "train.warmup_steps": 2,
        "train.log_every": 1,
        "train.eval_every": 5,
        "train.eval_batches": 2,
        "train.checkpoint_every": 5,
        "train.sample_tokens": 0,
        "hardware.precision": "fp32",
        "hardware.threads": 1,
        # auto times both kernels in every run and may pick either: runs compared loss by loss
        # must run the same one (tests/e2e/test_bf16_parity.py exercises auto)
        "model.attn_implementation": "sdpa",
    }
    base.update(extra)
    return TINY_ARCH + [f"{k}={v}" for k, v in base.items()]


def cli_env(**extra) -> dict:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update({"PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_cli(*args, cwd=None, env=None, timeout=600, check=False) -> subprocess.CompletedProcess:
    """`python -m cputrain ARGS` in a fresh process, as a user would run it."""
    proc = subprocess.run(
        [sys.executable, "-m", "cputrain", *map(str, args)],
        cwd=cwd or REPO, env=env or cli_env(), capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"cputrain {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One data/tokenizer cache for the whole session: tokenizers are trained once."""
    return tmp_path_factory.mktemp("cache")


def _train_tokenizer(folder: Path, vocab_size: int = 512):
    from cputrain.data.sources import _pydoc_documents
    from cputrain.data.tokenizer import train_bpe

    return train_bpe(_pydoc_documents()[:400], vocab_size, folder)


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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (shared data and schemas live beside the repository)")
    return SHARED


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory):
    """Conversations of very different lengths (answers of a few words to a few paragraphs), some
    with a system prompt and two turns, so micro-batches hold different numbers of trained tokens."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    with open(path, "w") as f:
        for i, name in enumerate(sorted(topics)):
            paragraphs = [" ".join(p.split()) for p in topics[name].split("\n\n") if len(p.strip()) > 40]
            answer = " ".join(paragraphs[: 1 + i % 3])[: 40 + 60 * (i % 5)]
            messages = [{"role": "user", "content": f"What is {name}?"}, {"role": "assistant", "content": answer}]
            if i % 3 == 0:
                messages = [{"role": "system", "content": "Answer briefly."}] + messages + [
                    {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def sft_overrides(chat_file) -> dict:
    """What turns tiny_overrides into a chat fine-tuning run on `chat_file`."""
    return {"data.source": chat_file, "data.format": "auto", "data.seq_len": 96, "data.max_documents": 80,
            "data.val_fraction": 0.1, "model.arch.max_position_embeddings": 128}
