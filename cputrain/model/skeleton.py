"""The model's structure: the Hugging Face causal LM (or a reward model's sequence classifier,
model.score_head) on the meta device, its decoder blocks, and
what is done to them (activation checkpointing, compiled blocks), and its parameter counts."""

from __future__ import annotations

import copy
import functools

import torch
import torch.utils.checkpoint
from torch import nn

from cputrain.config import ModelConfig, checkpointing_split, uses_selective
from cputrain.errors import ModelError, first_line
from cputrain.model.source import ModelSource


# The skeleton last built in this process, by what determines it. A rank asks for the same one
# up to four times (the checks before any work, LoRA's target layers, the plan of activation
# checkpointing, the trainer), and each changes its own (adapters, checkpointing): one build, and
# a copy for each (a meta copy takes milliseconds; an 8B build, seconds). One entry: a process
# builds one model, and a test session many.
_built: tuple[tuple, nn.Module] | None = None


def build_skeleton(source: ModelSource, cfg: ModelConfig) -> nn.Module:
    """The model with every parameter on the meta device: structure, no storage. Its config is
    `source.hf_config`, left as transformers' from_config leaves the config it builds from."""
    global _built
    # "auto" is decided by timing (the run's choices); a skeleton built before that, for a plan or
    # LoRA's targets, is the same either way
    attn = "sdpa" if cfg.attn_implementation == "auto" else cfg.attn_implementation
    key = (source.hf_config.to_json_string(), attn, cfg.trust_remote_code)
    if _built is None or _built[0] != key:
        _built = key, _from_config(copy.deepcopy(source.hf_config), attn, cfg.trust_remote_code)
    built = _built[1]
    # The copy holds the caller's config object, set as from_config sets the one it is given
    # (dtype, the attention kernel): the trainer exports that object as model/config.json.
    memo = {id(built.config): source.hf_config}
    model = copy.deepcopy(built, memo)
    source.hf_config.__dict__.update({name: copy.deepcopy(value, memo)
                                      for name, value in built.config.__dict__.items()})
    return model


def _from_config(hf_config, attn_implementation: str, trust_remote_code: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from cputrain.model.score_head import is_score_config

    # a reward model's config (model.score_head.fit_head) builds the sequence classifier
    auto = AutoModelForSequenceClassification if is_score_config(hf_config) else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            return auto.from_config(
                hf_config, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code,
                dtype=torch.float32,  # master weights stay fp32; bf16 is a compute choice (autocast)
            )
    except Exception as exc:
        raise ModelError(f"could not build the model from its config: {first_line(exc)}") from None


def enable_activation_checkpointing(model: nn.Module, setting: bool | int | str = True) -> None:
    """Checkpoint the model's blocks as model.activation_checkpointing says (resolved: true, false,
    a number of blocks, the first ones, selective: every block, keeping its matmul outputs, or
    "N+selective": the first N whole, the others selective). Blocks not checkpointed keep their
    activations: transformers checks each block's own `gradient_checkpointing` flag at every call."""
    if not setting:  # false or 0
        return
    # Non-reentrant checkpointing composes with FSDP2 and torch.compile.
    whole_kwargs = {"use_reentrant": False}
    if uses_selective(setting):
        from cputrain.model.selective_checkpointing import checkpoint_kwargs

        kwargs = checkpoint_kwargs()
    else:
        kwargs = whole_kwargs
    # transformers checkpoints each block's forward, not its __call__: FSDP2's hooks on the block
    # (all-gather, reshard) stay outside the checkpoint and do not run again in the recompute.
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x: the other name warns on every run
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if setting is True or setting == "selective":  # `is`, not ==: 1 == True, and one block is not all
        return
    blocks = decoder_blocks(model)
    whole, selective = checkpointing_split(setting, len(blocks))
    if selective:
        # transformers gives every block one checkpoint function; the first `whole` get the plain one
        for block in blocks[:whole]:
            block._gradient_checkpointing_func = functools.partial(torch.utils.checkpoint.checkpoint,
                                                                   **whole_kwargs)
    else:
        # N blocks: any architecture with findable blocks (true needs none)
        for block in blocks[whole:]:
            block.gradient_checkpointing = False


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (model.model.layers in Llama-style HF models)."""
    for attr in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        node = model
        for part in attr.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, nn.ModuleList):
            return list(node)
    raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}")


def compile_blocks(model: nn.Module, cache_dir: str) -> None:
    """Compile each decoder block's forward in place (regional compilation).

    The blocks are identical, so inductor compiles one and reuses it; the embedding, the head
    and the loss stay eager. Only `forward` is compiled, not the module call: the hooks that
    DDP, FSDP2 and DeepSpeed put on a block stay outside the graph, and parameter names (so
    checkpoints and the export) are those of an eager run. benchmarks/step_time/step_profile.py measures
    it against eager on the machine at hand (docs/benchmarks/step-time.md).
    """
    import os

    # Inductor keeps compiled kernels here between runs, so only the first run pays for compiling.
    # Assigned, not defaulted: torch writes its own default (/tmp/torchinductor_<user>) into the
    # variable the first time anything asks for the folder, which can be before this call.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    for block in decoder_blocks(model):
        block.forward = torch.compile(block.forward)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Total and non-embedding parameters (the input embedding table is a lookup, not a matmul),
    and the non-embedding ones that are trained (all of them, or only LoRA adapters)."""
    params = list(model.parameters())  # each shared parameter once
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    emb = model.get_input_embeddings().weight
    tied = getattr(model.config, "tie_word_embeddings", False)
    # A tied lm_head still does a vocab × hidden matmul per token: keep it in the compute count.
    non_embedding = total - emb.numel() + (emb.numel() if tied else 0)
    trained_non_embedding = trained - (emb.numel() if emb.requires_grad and not tied else 0)
    return {"total": total, "non_embedding": non_embedding, "embedding": emb.numel(),
            "trained": trained, "trained_non_embedding": trained_non_embedding}
