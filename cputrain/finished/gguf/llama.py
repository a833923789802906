"""A Llama's hyperparameters and tensors as llama.cpp's `llama` architecture reads them.

Names come from the gguf package (TensorNameMap: `model.layers.0.self_attn.q_proj.weight` →
`blk.0.attn_q.weight`). The row permutation of the Q and K projections is written here: the
library has no model code. Hugging Face's Llama rotates each head's dimension i with i + d/2
(`rotate_half`); llama.cpp's `llama` rotates the adjacent pairs 2i, 2i+1, as Meta's original
weights did, and Hugging Face's conversion script reordered those weights' rows for its layout.
`permute_for_llama_cpp` puts the rows back: row (h, half, i) goes to (h, i, half). The product
q·k is unchanged, as q and k are reordered alike; v and the output projection are not touched.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from cputrain.errors import ModelError

ARCH = "llama"


def permute_for_llama_cpp(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a Q or K projection (or its bias) from rotate-half order to interleaved pairs."""
    rows = weight.shape[0]
    return (weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def check_llama(config, folder) -> None:
    if getattr(config, "model_type", None) != "llama":
        raise ModelError(f"'{folder}' holds a {getattr(config, 'model_type', None) or 'non-Llama'} model; "
                         "--gguf exports Llama models (model_type llama) only")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config) -> dict:
    """transformers 5 keeps rope_theta and the scaling in rope_parameters; 4.x in two attributes."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def add_hyperparameters(writer, config) -> None:
    import gguf

    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim(config))
    if head_dim(config) != config.hidden_size // config.num_attention_heads:  # llama.cpp assumes it otherwise
        writer.add_key_length(head_dim(config))
        writer.add_value_length(head_dim(config))
    rope = rope_parameters(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif rope["rope_type"] not in ("default", "llama3"):  # llama3's scaling is a tensor (rope_freqs)
        raise ModelError(f"rope scaling '{rope['rope_type']}' is not exported to GGUF here (default, linear and "
                         "llama3 are); convert this model with llama.cpp's convert_hf_to_gguf.py")


def llama3_rope_factors(config) -> torch.Tensor | None:
    """Llama-3.1's rope scaling as llama.cpp takes it: one factor per rotated pair (rope_freqs.weight),
    computed from the config as transformers' _compute_llama3_parameters does."""
    rope = rope_parameters(config)
    if rope["rope_type"] != "llama3":
        return None
    dim = head_dim(config)
    freqs = 1.0 / (float(rope["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_context = float(rope["original_max_position_embeddings"])
    factors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def gguf_tensors(state_dict: dict[str, torch.Tensor], config) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor ready to store) for each weight, Q and K permuted, the tied head left out
    (llama.cpp reads the token embedding as the output layer when output.weight is absent)."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    n_heads = config.num_attention_heads
    n_kv_heads = config.num_key_value_heads or n_heads
    factors = llama3_rope_factors(config)
    if factors is not None:
        yield gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors
    for name, tensor in state_dict.items():
        if name.endswith("rotary_emb.inv_freq"):  # a buffer recomputed from the config
            continue
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ModelError(f"tensor '{name}' has no name in llama.cpp's llama architecture; "
                             "this is not a plain Llama")
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = permute_for_llama_cpp(tensor, n_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = permute_for_llama_cpp(tensor, n_kv_heads)
        yield gguf_name, tensor
