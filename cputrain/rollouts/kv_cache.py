"""The rollout's KV cache: every layer's keys and values written in place into tensors sized once
for the prompt and all new tokens, so a decode step copies only its own token's keys (transformers'
DynamicCache concatenates, copying the whole cache every step), and rows can be dropped.

Measured, the copies saved are worth little (1.02× at the demo's size, 1.04× at ~100M); what keeps
it is memory: the cache is allocated once, at the size kv_cache_bytes() tells the plan, where a
concatenation holds the old cache and the new one at once every step."""

from __future__ import annotations

import torch


def _preallocated_layer_class():
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A DynamicLayer whose keys and values are views of tensors allocated for `capacity`
        positions at the first write."""

        def __init__(self, capacity: int, **kwargs):
            super().__init__(**kwargs)
            self.capacity = capacity
            self.length = 0

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
            value_states = key_states if value_states is None else value_states  # transformers 4.x passes keys only
            rows, heads, _, _ = key_states.shape
            self.device = key_states.device
            # Under the trainer's bf16 autocast, Llama's keys leave the rotary embedding in fp32 and
            # attention's products cast them to bf16 again every step: kept in bf16, the cache
            # holds half the bytes and is not cast whole each step (the products see the same values).
            dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else key_states.dtype
            self.key_store = key_states.new_empty((rows, heads, self.capacity, key_states.shape[-1]), dtype=dtype)
            self.value_store = value_states.new_empty((rows, value_states.shape[1], self.capacity,
                                                       value_states.shape[-1]), dtype=dtype)
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            self.key_store[:, :, self.length:end] = key_states
            self.value_store[:, :, self.length:end] = value_states
            self.length = end
            self.keys, self.values = self.key_store[:, :, :end], self.value_store[:, :, :end]
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self.key_store = self.key_store.index_select(0, indices)
                self.value_store = self.value_store.index_select(0, indices)
                self.keys, self.values = self.key_store[:, :, :self.length], self.value_store[:, :, :self.length]

    return PreallocatedLayer


def rollout_cache(config, capacity: int):
    """A transformers DynamicCache for `config` whose full-attention layers hold `capacity` positions
    preallocated; layers of another kind (sliding windows, linear attention) stay as transformers
    builds them, as does the whole cache where its layers are not a list of DynamicLayers."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list) and layers and all(type(layer) is DynamicLayer for layer in layers):
        preallocated = _preallocated_layer_class()
        cache.layers = [preallocated(capacity) for _ in layers]
    return cache


def cache_keyword(model) -> str:
    """The keyword the model's forward takes its cache under: `cache` from transformers 5.x (where
    `past_key_values` is deprecated), `past_key_values` before."""
    from cputrain.model.forward_keywords import forward_takes

    return "cache" if forward_takes(model, "cache") else "past_key_values"


def select_rows(cache, indices: torch.Tensor) -> None:
    """Only the rows `indices` stay in the cache, in their order: finished rows dropped, or a shared
    prompt's rows repeated for each of its completions."""
    cache.batch_select_indices(indices)
