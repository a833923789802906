"""A model attending through one of cputrain's attention functions for the length of a block:
registered with transformers' AttentionInterface under its name, set as the config's
implementation, and the run's own restored after. Used where a forward needs math the run's kernel
does not do alone: a rollout's one-token decode steps (rollouts/decode_attention.py), online RL's
rows that share a prompt (kernels/shared_prompt_attention.py)."""

from __future__ import annotations

from contextlib import contextmanager

FOLLOWS = ("sdpa", "eager")  # the run's kernels whose math cputrain's attention functions repeat


@contextmanager
def swapped_attention(config, name: str, function, mask_function=None):
    """For the block: the model `config` describes attends through `function` (and builds its masks
    with `mask_function`, where given), where it attends through sdpa or eager and this
    transformers has the interfaces; yields the kernel it replaced, or None (the model's own
    attention runs)."""
    try:
        from transformers import AttentionInterface

        if mask_function is not None:
            from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        yield None
        return
    before = getattr(config, "_attn_implementation", None)
    if before not in FOLLOWS:
        yield None
        return
    AttentionInterface.register(name, function)
    if mask_function is not None:
        AttentionMaskInterface.register(name, mask_function)
    config._attn_implementation = name
    try:
        yield before
    finally:
        config._attn_implementation = before
