"""The next token of every row, drawn from the last position's logits the way transformers' sampling
warps them (temperature, then top-k, then top-p), from the caller's generator alone."""

from __future__ import annotations

import torch


def warped_scores(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The scores sampling draws from (rows × vocab, fp32): the logits divided by the temperature,
    then all but the top-k set to -inf, then all outside the top-p mass — transformers'
    TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper, in their order."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if top_p < 1.0:
        # drop the least likely tokens whose mass together stays within 1 - top_p, always keeping
        # the most likely one
        ascending, order = torch.sort(scores, dim=-1)
        mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = mass_below <= 1 - top_p
        drop_sorted[..., -1] = False
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return scores


def next_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator) -> torch.Tensor:
    """One token per row (rows × vocab logits → rows): the argmax where the temperature is 0, else a
    draw from the warped distribution.

    The draw inverts each row's cumulative distribution at one uniform number: one random number a
    row, where torch.multinomial draws an exponential for every token of the vocabulary (at 64 rows
    × 4k tokens that was a tenth of a decode step)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    cumulative = warped_scores(logits, temperature, top_k, top_p).softmax(dim=-1).cumsum(dim=-1)
    uniform = torch.rand((logits.shape[0], 1), generator=generator, dtype=cumulative.dtype) * cumulative[:, -1:]
    # the first token whose cumulative mass exceeds the draw: a token of zero mass never does
    return torch.searchsorted(cumulative, uniform, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
