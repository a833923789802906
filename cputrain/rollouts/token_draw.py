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


# How many of the most likely tokens top-p looks among before it sorts the whole vocabulary: the
# nucleus lies within them whenever they hold top_p of the mass (the usual case; a flat row falls
# back to the full sort). Sorting 64 rows of 4,096 logits took 6 ms a step on one core, a tenth of
# the decode step of the demo's model; a 150k vocabulary would take a quarter of a second.
NUCLEUS_CANDIDATES = 256


def next_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator) -> torch.Tensor:
    """One token per row (rows × vocab logits → rows): the argmax where the temperature is 0, else a
    draw from the distribution warped_scores() leaves.

    The draw inverts each row's cumulative distribution at one uniform number: one random number a
    row, where torch.multinomial draws an exponential for every token of the vocabulary (at 64 rows
    × 4k tokens that was a tenth of a decode step). Top-k and top-p work on the k (or
    NUCLEUS_CANDIDATES) most likely tokens only, not on a sort of the whole vocabulary."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab or (top_p < 1.0 and NUCLEUS_CANDIDATES < vocab):
        drawn = _draw_among_candidates(logits.float() / temperature, top_k, top_p, generator)
        if drawn is not None:
            return drawn
    if top_k == 0 and top_p >= 1.0:
        # plain sampling: the draw takes unnormalised probabilities, so neither the softmax's
        # division nor (at temperature 1) the temperature's is paid: two passes over rows × vocab
        scores = logits.float() if temperature == 1.0 else logits.float() / temperature
        return _draw((scores - scores.amax(dim=-1, keepdim=True)).exp_(), generator)
    return _draw(warped_scores(logits, temperature, top_k, top_p).softmax(dim=-1), generator)


def _draw(probabilities: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """An index per row, drawn with the row's probabilities (which need not sum to one)."""
    cumulative = probabilities.cumsum(dim=-1)
    uniform = torch.rand((probabilities.shape[0], 1), generator=generator, dtype=cumulative.dtype) * cumulative[:, -1:]
    # the first index whose cumulative mass exceeds the draw: an index of zero mass never does
    return torch.searchsorted(cumulative, uniform, right=True).squeeze(-1).clamp(max=probabilities.shape[-1] - 1)


def _draw_among_candidates(scores: torch.Tensor, top_k: int, top_p: float,
                           generator: torch.Generator) -> torch.Tensor | None:
    """The draw of next_tokens on the most likely tokens alone (scores already divided by the
    temperature); None where top-p's nucleus may reach beyond them (then the caller sorts all)."""
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        values, ids = torch.topk(scores, top_k + 1, dim=-1)  # most likely first, and the next one
        if bool((values[:, top_k - 1] == values[:, top_k]).any()):
            return None  # transformers keeps every token tied with the k-th: more than k
        values, ids = values[:, :top_k], ids[:, :top_k]
        probabilities = values.softmax(dim=-1)  # top-k left only these: top-p's softmax is over them
    else:
        values, ids = torch.topk(scores, NUCLEUS_CANDIDATES, dim=-1)
        probabilities = (values - torch.logsumexp(scores, dim=-1, keepdim=True)).exp()
        # every token past the candidates has at least the candidates but the last above it: where
        # they hold top_p, top-p removes it (and the last candidate), whatever the order of ties
        if bool((probabilities[:, :-1].sum(dim=-1) < top_p).any()):
            return None
    if top_p < 1.0:
        # transformers keeps a token unless the tokens more likely than it already hold top_p
        kept = probabilities.cumsum(dim=-1) - probabilities < top_p
        kept[:, 0] = True  # the most likely token always stays, as transformers' min_tokens_to_keep=1
        probabilities = probabilities * kept
    return ids.gather(-1, _draw(probabilities, generator)[:, None]).squeeze(-1)
