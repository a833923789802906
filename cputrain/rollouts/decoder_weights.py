"""The policy's weights in the form a rollout's decode step wants them, taken once per rollout:
each block's query, key and value projections as one matrix and its gate and up projections as
another, LoRA's adapters merged in, everything in the dtype the step computes in.

Why a copy and not the modules: a decode step multiplies a few dozen rows by every weight, so it
is bound by how many products it launches and what each costs around it. Through transformers'
modules a Llama block is seven products (plus two per LoRA adapter, and under the trainer's bf16
autocast a cast of every fp32 weight to bf16 on every call, every token); here it is four, cast
once. The copy costs up to the weights once more in the compute dtype for the rollout's length
(fused_weight_size.py tells the memory plan how much).

Which models: decoder-only Llamas and the families whose blocks are a Llama's (Qwen2 with its
projection biases, Mistral without a sliding window), unsharded (single or DDP) or sharded by
FSDP2. Anything else (a sliding window, norms on the queries and keys, DoRA, ZeRO-3's emptied
parameters) gets None, and the rollout runs through the model's own modules as before.

Under FSDP2 each unit (the root, then each block) is gathered with FSDP2's own unshard(), in the
dtype its mixed-precision policy computes in, copied from and sharded again: once a rollout, so
every rank must call decoder_weights() together, rows to sample or not (sampling.sample does). The
rollout then decodes with no collective at all, where the modules would gather every block for
every token. The cost is the whole model in the compute dtype on each rank for the rollout
(fused_weight_size.py counts it), instead of one block at a time.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from cputrain.rollouts.packed_weights import for_products, reorders

FAMILIES = ("llama", "qwen2", "mistral")


@dataclass
class BlockWeights:
    input_norm: torch.Tensor  # fp32
    qkv: torch.Tensor  # (q + 2·kv) × hidden, compute dtype (in bf16 reordered: packed_weights.py)
    qkv_bias: torch.Tensor | None
    out: torch.Tensor
    out_bias: torch.Tensor | None
    post_norm: torch.Tensor  # fp32
    gate_up: torch.Tensor  # 2·intermediate × hidden
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass
class DecoderWeights:
    embed: torch.Tensor  # the embedding table as the model holds it (looked up, never multiplied)
    blocks: list[BlockWeights]
    final_norm: torch.Tensor
    head: torch.Tensor  # vocab × hidden, compute dtype
    rotary: torch.nn.Module  # the model's own rotary embedding (its scaling and rope type)
    norm_eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    dtype: torch.dtype  # what the products compute in


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module under torch.compile's and activation checkpointing's wrappers."""
    for attribute in ("_orig_mod", "_checkpoint_wrapped_module"):
        module = getattr(module, attribute, module)
    return module


def _effective(linear: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) a linear layer applies, its active LoRA adapters merged in (peft's own delta)."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
    weight = base.weight.detach()
    if not getattr(linear, "disable_adapters", False) and not getattr(linear, "merged", False):
        for adapter in linear.active_adapters:
            if adapter not in getattr(linear, "lora_A", {}):
                continue
            weight = weight + linear.get_delta_weight(adapter).to(weight.dtype)
    return weight, None if base.bias is None else base.bias.detach()


def _own(tensor: torch.Tensor, dtype: torch.dtype, copy: bool) -> torch.Tensor:
    """`tensor` in `dtype`; a copy where `copy` (FSDP2's reshard() frees a gathered unit's storage)."""
    return tensor.to(dtype, copy=copy)


def _fused(linears: list[torch.nn.Module], dtype: torch.dtype, copy: bool):
    """One weight (and bias, if any projection has one) for several projections of one input, the
    weight as the decode step multiplies it fastest (packed_weights.for_products)."""
    parts = [_effective(linear) for linear in linears]
    if len(parts) == 1:  # the layer's own tensors where the dtype is theirs: no copy unless `copy`
        weight, bias = parts[0]
        # reordering makes a new tensor itself: no copy first
        weight = for_products(_own(weight, dtype, copy and not reorders(dtype)))
        return weight, None if bias is None else _own(bias, dtype, copy)
    weight = for_products(torch.cat([w.to(dtype) for w, _ in parts]))
    if all(b is None for _, b in parts):
        return weight, None
    bias = torch.cat([(b if b is not None else w.new_zeros(w.shape[0])).to(dtype) for w, b in parts])
    return weight, bias


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`model`'s FSDP2 units, outermost (the root) first; [] where it is not sharded by FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def _gathered(unit: torch.nn.Module | None):
    """FSDP2's `unit` gathered whole for the reads inside (a collective), then sharded again."""
    if unit is None:
        yield
        return
    unit.unshard()
    try:
        yield
    finally:
        unit.reshard()


def _unit_of(layer: torch.nn.Module, units: list[torch.nn.Module]) -> torch.nn.Module | None:
    """The FSDP2 unit that holds `layer`'s parameters (its own, under any wrapper), or None."""
    return next((m for m in layer.modules() if m in units), None)  # a module's == is its identity


def _why_not(causal) -> str | None:
    config = getattr(causal, "config", None)
    if config is None or getattr(config, "model_type", None) not in FAMILIES:
        return f"model type {getattr(config, 'model_type', None)!r} is not one of {FAMILIES}"
    if getattr(config, "sliding_window", None):
        return "a sliding window"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if any(p.numel() == 0 for p in causal.parameters()):
        # ZeRO-3's emptied parameters: its modules gather them block by block, with the other ranks
        return "ZeRO-3's partitioned parameters"
    decoder = getattr(causal, "model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        return "no decoder with layers and a rotary embedding"
    if type(decoder.embed_tokens) is not torch.nn.Embedding:  # an adapted or wrapped table: its own lookup
        return f"an embedding of type {type(decoder.embed_tokens).__name__}"
    attention = _unwrap(decoder.layers[0]).self_attn
    if hasattr(attention, "q_norm") or hasattr(attention, "k_norm"):
        return "norms on the queries and keys"
    if getattr(getattr(causal.lm_head, "base_layer", causal.lm_head), "bias", None) is not None:
        return "a head with a bias"
    if any(any(getattr(m, "use_dora", {}).values()) for m in causal.modules()):
        return "DoRA adapters (their magnitude vector is not a delta to merge)"
    return None


def _causal(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the model


def why_not_fused(model) -> str | None:
    """Why decoder_weights() does not take `model` (None: it does), checked on its structure, no weight copied."""
    return _why_not(_causal(model))


def runs_fused(model) -> bool:
    return why_not_fused(model) is None


def decoder_weights(model, dtype: torch.dtype | None) -> DecoderWeights | None:
    """`model`'s weights for fused_decoder's step in `dtype` (None: the dtype FSDP2 gathers them in),
    or None where the model is not one it runs (the module path then samples)."""
    causal = _causal(model)
    if _why_not(causal) is not None:
        return None
    decoder, config = causal.model, causal.config
    units = fsdp_units(model)
    copy = bool(units)
    with torch.no_grad(), _gathered(units[0] if units else None):
        if dtype is None:
            dtype = decoder.embed_tokens.weight.dtype
        blocks = []
        for layer in decoder.layers:
            with _gathered(_unit_of(layer, units[1:])):
                layer = _unwrap(layer)
                attention, mlp = layer.self_attn, layer.mlp
                blocks.append(BlockWeights(
                    _own(layer.input_layernorm.weight.detach(), torch.float32, copy),
                    *_fused([attention.q_proj, attention.k_proj, attention.v_proj], dtype, copy),
                    *_fused([attention.o_proj], dtype, copy),
                    _own(layer.post_attention_layernorm.weight.detach(), torch.float32, copy),
                    *_fused([mlp.gate_proj, mlp.up_proj], dtype, copy), *_fused([mlp.down_proj], dtype, copy)))
        head = _fused([causal.lm_head], dtype, copy)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        embed = decoder.embed_tokens.weight.detach()
        return DecoderWeights(
            embed=_own(embed, embed.dtype, copy), blocks=blocks,
            final_norm=_own(decoder.norm.weight.detach(), torch.float32, copy), head=head[0],
            rotary=decoder.rotary_emb, norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=head_dim,
            scaling=float(getattr(_unwrap(decoder.layers[0]).self_attn, "scaling", head_dim ** -0.5)), dtype=dtype)
