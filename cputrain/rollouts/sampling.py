"""Completions sampled from the policy as the trainer holds it: a batch of prompts, prefilled once,
then decoded a token a step from a KV cache, each row ending at a stop token or at max_new_tokens.

Sampling follows transformers' order (temperature, then top-k, then top-p) and draws only from the
generator it is given, so a resumed run that restores the generator's state samples the same.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop_token_ids: tuple[int, ...] = ()  # EOS and the end of a chat turn
    pad_token_id: int = 0


@dataclass
class Rollout:
    completion_ids: list[list[int]]  # each unpadded; ends with its stop token where one was sampled
    stopped: list[bool]  # False: max_new_tokens reached first ("clipped")
    prefill_s: float
    decode_s: float
    new_tokens: int


def next_tokens(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator) -> torch.Tensor:
    """One token per row from the last position's logits (rows × vocab): argmax where the
    temperature is 0, else drawn from the distribution that temperature, top-k and top-p leave."""
    if settings.temperature == 0:
        return logits.argmax(dim=-1)
    return torch.multinomial(warped_scores(logits, settings).softmax(dim=-1), 1, generator=generator).squeeze(-1)


def warped_scores(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The scores sampling draws from: the logits divided by the temperature, then all but the top-k
    set to -inf, then all outside the top-p mass (transformers' warpers, in their order)."""
    scores = logits.float() / settings.temperature
    if 0 < settings.top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, settings.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if settings.top_p < 1.0:
        # transformers' TopPLogitsWarper: drop the least likely tokens whose mass together stays
        # within 1 - top_p, always keeping the most likely one
        ascending, order = torch.sort(scores, dim=-1)
        mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = mass_below <= 1 - settings.top_p
        drop_sorted[..., -1] = False
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return scores


def _left_padded(prompt_ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded batch, and its attention mask (1 on real tokens)."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, prompt in enumerate(prompt_ids):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids, mask


def _dummy_forward(model, pad_token_id: int) -> None:
    """One forward of one token, no cache: what a rank with nothing left to decode runs so that a
    sharded model's collectives meet those of the ranks still decoding."""
    model(input_ids=torch.tensor([[pad_token_id]]), use_cache=False)


def cache_keyword(model) -> str:
    """The name the model's forward takes its KV cache under: `cache` from transformers 5.x, where
    `past_key_values` is deprecated; `past_key_values` before."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the model
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def sample(model, prompt_ids: list[list[int]], settings: SamplingSettings, generator: torch.Generator,
           any_rank_running: Callable[[bool], bool] | None = None) -> Rollout:
    """Completions of `prompt_ids` (one per prompt) from `model`, in eval mode and without grad; the
    model's train/eval modes are restored after. `any_rank_running` (an all-reduce the caller
    provides) keeps the ranks of a sharded model stepping together until every rank is done."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            return _sample(model, prompt_ids, settings, generator, any_rank_running)
    finally:
        for module, training in modes:
            module.training = training


def _sample(model, prompt_ids, settings, generator, any_rank_running) -> Rollout:
    rows = len(prompt_ids)
    completions: list[list[int]] = [[] for _ in range(rows)]
    stopped = [False] * rows
    stop = torch.tensor(settings.stop_token_ids, dtype=torch.long)
    start = time.perf_counter()
    if rows == 0 or settings.max_new_tokens <= 0:
        if any_rank_running is not None:
            _dummy_forward(model, settings.pad_token_id)
            while any_rank_running(False):
                _dummy_forward(model, settings.pad_token_id)
        return Rollout(completions, stopped, time.perf_counter() - start, 0.0, 0)
    ids, mask = _left_padded(prompt_ids, settings.pad_token_id)
    # positions count real tokens only, so a left-padded row sees the positions it would alone
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    from transformers import DynamicCache

    keyword = cache_keyword(model)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                   **{keyword: cache}).logits[:, -1, :]
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    running = torch.ones(rows, dtype=torch.bool)
    next_position = positions[:, -1:] + 1
    step = 0
    while True:
        token = next_tokens(logits, settings, generator)
        token = torch.where(running, token, torch.full_like(token, settings.pad_token_id))
        for row in running.nonzero().flatten().tolist():
            completions[row].append(int(token[row]))
        step += 1
        ends = running & torch.isin(token, stop)
        for row in ends.nonzero().flatten().tolist():
            stopped[row] = True
        running = running & ~ends
        if step >= settings.max_new_tokens:
            running[:] = False
        local = bool(running.any())
        if not (any_rank_running(local) if any_rank_running is not None else local):
            break
        if not local:  # this rank is done, another is not: meet its collectives until all are done
            _dummy_forward(model, settings.pad_token_id)
            while any_rank_running(False):
                _dummy_forward(model, settings.pad_token_id)
            break
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype)], dim=-1)
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_position, use_cache=True,
                       **{keyword: cache}).logits[:, -1, :]
        next_position = next_position + 1
    return Rollout(completions, stopped, prefill_s, time.perf_counter() - start,
                   sum(len(c) for c in completions))
