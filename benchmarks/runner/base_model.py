"""The base model the fine-tuning benchmarks train (LoRA, SFT, DPO, KTO, the allocators and the
heap): a Llama of a given shape with random weights, saved as a Hugging Face folder with a
byte-level BPE trained on the benchmark's corpus through cputrain's own tokenizer cache."""

from __future__ import annotations

from pathlib import Path

VOCAB = 8192  # the base's tokenizer
SEED = 1337  # its random weights


def shared_tokenizer(source: str, cache_dir: str, vocab: int):
    """The BPE of `vocab` tokens trained on `source`, from cputrain's cache (trained once, read by every run)."""
    from cputrain.config import DataConfig, ModelConfig
    from cputrain.data import sources, tokenizer

    data_cfg = DataConfig(source=source, cache_dir=cache_dir)
    return tokenizer.get_tokenizer(ModelConfig(tokenizer_vocab_size=vocab), data_cfg, sources.fingerprint(data_cfg),
                                   lambda: sources.open_corpus(data_cfg))


def make_base(folder: Path, arch: dict, source: str, cache_dir: str, dtype: str, vocab: int = VOCAB) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = shared_tokenizer(source, cache_dir, vocab)
    config = LlamaConfig(**arch, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(folder)  # safetensors
    tok.save_pretrained(folder)
    embedding = sum(m.weight.numel() for m in (model.model.embed_tokens, model.lm_head))
    return {"parameters": sum(p.numel() for p in model.parameters()), "embedding_parameters": embedding,
            "vocab": len(tok)}
