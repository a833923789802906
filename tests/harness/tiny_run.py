"""The key=value overrides of a run that takes seconds: a tiny Llama, short sequences, few documents;
and what turns it into chat fine-tuning."""

from __future__ import annotations

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
        # auto would start a one-process run a second time with tcmalloc preloaded where it is
        # installed (tests/unit/test_placement.py tests that re-exec)
        "hardware.allocator": "system",
    }
    base.update(extra)
    return TINY_ARCH + [f"{k}={v}" for k, v in base.items()]


def sft_overrides(chat_file) -> dict:
    """What turns tiny_overrides into a chat fine-tuning run on `chat_file` (harness.chat_data)."""
    return {"data.source": chat_file, "data.format": "auto", "data.seq_len": 96, "data.max_documents": 80,
            "data.val_fraction": 0.1, "model.arch.max_position_embeddings": 128}
