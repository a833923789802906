"""Whether a model's forward takes a keyword, seen through the wrappers a run puts around it:
`logits_to_keep` (some positions' logits only, transformers' causal LMs since 4.50: a rollout's
prefill wants the last position's, online RL's step those that predict a completion token) and
`cache` (a rollout's KV cache; `past_key_values` before transformers 5)."""

from __future__ import annotations

import inspect

import torch


def forward_takes(model, keyword: str) -> bool:
    inner = model
    while isinstance(getattr(inner, "module", None), torch.nn.Module):  # DDP's and DeepSpeed's wrappers
        inner = inner.module
    if hasattr(inner, "get_base_model"):  # peft
        inner = inner.get_base_model()
    # the class's forward, not the instance's: the chunked head (kernels/chunked_head.py) replaces
    # the instance's with one that takes **kwargs and hands them to the class's
    forward = getattr(type(inner), "forward", None)
    return forward is not None and keyword in inspect.signature(forward).parameters
