"""The GGUF output types and how one tensor becomes one of them.

Only matrices take the chosen type: 1-D tensors (the RMSNorm weights) stay f32, as llama.cpp's
own converter keeps them (they are tiny, and llama.cpp adds them in f32). K-quants (Q4_K_M …) are
not written here: gguf.quants can only read them, and llama.cpp's `llama-quantize` makes them from
a bf16 file with its per-tensor mixture (Q4_K_M keeps some attention and FFN matrices in Q6_K),
which this module would otherwise have to copy.
"""

from __future__ import annotations

import numpy as np
import torch

from cputrain.errors import ModelError, UserError

# What this export writes: every matrix in that type, every 1-D tensor in f32.
TYPES = ("f32", "f16", "bf16", "q8_0")
F16_MAX = 65504.0  # the largest finite float16
# Left to llama-quantize, which makes them from a bf16 file (its own names, lower-cased): the K-quants,
# and the 4/5-bit block types, which it writes with the same per-tensor mixture.
LLAMA_QUANTIZE_TYPES = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "q4_0", "q4_1",
            "q5_0", "q5_1", "iq4_nl", "iq4_xs")


def file_type(name: str):
    import gguf

    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[name]


def check_type(name: str, source: str, out_bf16: str) -> None:
    """Refuse a type this export does not write, in one line; a K-quant's line gives the commands."""
    if name in TYPES:
        return
    if name.lower() in LLAMA_QUANTIZE_TYPES:
        raise UserError(f"--gguf {name} is made by llama.cpp's llama-quantize from a bf16 file: "
                        f"cputrain export {source} --gguf bf16 && llama-quantize {out_bf16} "
                        f"{out_bf16.removesuffix('-bf16.gguf')}-{name.lower()}.gguf {name.upper()}")
    raise UserError(f"--gguf {name}: unknown type; choose one of {', '.join(TYPES)} "
                    f"(or a K-quant such as q4_k_m through llama-quantize)")


def convert(gguf_name: str, tensor: torch.Tensor, type_name: str) -> tuple[np.ndarray, object | None]:
    """The tensor as it is stored: (array, raw GGML type or None where numpy's dtype says it)."""
    import gguf

    if not torch.isfinite(tensor).all():
        raise ModelError(f"tensor {gguf_name} has non-finite weights (NaN or inf): the model diverged in training; "
                         "nothing was written")
    data = tensor.detach().to(torch.float32).contiguous().numpy()
    if tensor.dim() < 2 or type_name == "f32":
        return data, None
    if type_name == "f16":
        peak = float(np.abs(data).max())
        if peak > F16_MAX:
            raise ModelError(f"tensor {gguf_name} holds {peak:.4g}, beyond float16's largest {F16_MAX:g}: "
                             "this model does not fit f16; export --gguf bf16 (same size, float32's range)")
        return data.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType.BF16 if type_name == "bf16" else gguf.GGMLQuantizationType.Q8_0
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.quants.QuantError:  # rows not a whole number of q8_0's 32-value blocks: kept exact
        return data, None
