"""Completions sampled from the policy as the trainer holds it: a batch of prompts, prefilled once,
then decoded a token a step from a KV cache, each row ending at a stop token or at max_new_tokens.

Sampling follows transformers' order (temperature, then top-k, then top-p) and draws only from the
generator it is given, so a resumed run that restores the generator's state samples the same.

Two paths, one loop. A Llama-family policy, unsharded or sharded by FSDP2, decodes on its own
weights fused and merged once per rollout (decoder_weights.py, fused_decoder.py): four products a
block, LoRA's adapters merged, no per-token cast under autocast, no collective (each rank decodes its
rows to its own end; under FSDP2 the ranks gather the weights together first, rows or not). Any
other model (ZeRO-3's included) runs through its own modules (`_ModuleSteps`), ranks kept in step
by `any_rank_running`. `Rollout.path` says which ran.

What makes it faster than `model.generate()` (each measured, docs/benchmarks/online-rl.md):
- the fused decoder above, where the model is one it runs;
- the prefill's head computes the last position's logits only;
- the KV cache is written in place into tensors sized once (kv_cache.py), not concatenated;
- the attention mask is built once and passed as a view (attention_masks.py);
- one uniform number a row draws the token (token_draw.py), not an exponential per vocabulary entry;
- finished rows leave the batch (their cache rows dropped), so the last long completions decode
  alone instead of dragging the whole batch along;
- a prompt repeated in the batch (GRPO's generations of one prompt) is prefilled once; on the fused
  decoder its keys and values are then held and read once for all its rows (paged_kv_cache.py),
  through the modules its cache rows are copied for each completion;
- the fused decoder's weights are reordered into oneDNN's layout once a rollout (packed_weights.py):
  in bf16 not on every product, in fp32 oneDNN's product instead of MKL's, which is slow at a few rows;
- a decode step's attention is two batched products (decode_attention.py), not sdpa's CPU kernel.

What it does not do: compile the decode step. Measured at the demo's size (64 rows, one core), a
compiled forward through the modules over a static cache took 15.1 ms a step against 17.6 eager
(fp32; bf16 16.5 against 18.8), and its first call 23–25 s: about 10,000 decode steps, some 200
rollouts of 48 tokens, before it pays, and again whenever the batch's shape changes (rows dropped, a
longer prompt). On the fused decoder (bf16, 64 rows, 2 threads) it was slower outright: each block's
products and elementwise work compiled around the eager attention took 7.4 ms a step against 6.1 eager
(inductor multiplies the dense weights, and each compiled call costs its wrapper), and the whole step
compiled with the cache as an input 28.7 ms against 5.2 (the cache's in-place writes became copies
of the whole cache).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cputrain.model.forward_keywords import forward_takes
from cputrain.rollouts.attention_masks import RolloutMasks
from cputrain.rollouts.decode_attention import decode_attention
from cputrain.rollouts.decoder_weights import decoder_weights, fsdp_units, runs_fused
from cputrain.rollouts.fused_decoder import FusedDecoder
from cputrain.rollouts.kv_cache import cache_keyword, rollout_cache, select_rows
from cputrain.rollouts.token_draw import next_tokens


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
    path: str = "modules"  # "fused": fused_decoder.py on the policy's merged weights; "modules": the model's own


def _left_padded(prompt_ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded batch, and its padding mask (1 on real tokens)."""
    width = max(max(len(p) for p in prompt_ids), 1)
    ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, prompt in enumerate(prompt_ids):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids, mask


def _keep_step_until_all_done(model, pad_token_id: int, any_rank_running: Callable[[bool], bool]) -> None:
    """What a rank with nothing (left) to decode runs while another rank decodes: one forward of one
    token, no cache, per step of theirs, so that a sharded model's collectives meet theirs."""
    model(input_ids=torch.tensor([[pad_token_id]]), use_cache=False)
    while any_rank_running(False):
        model(input_ids=torch.tensor([[pad_token_id]]), use_cache=False)


class _Forward:
    """The model's forward as a rollout calls it: the cache under the keyword this transformers
    takes (`cache` from 5.x, `past_key_values` before), the logits of the last position only where
    the model can keep just those."""

    def __init__(self, model):
        self.model = model
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the model
        self.cache_keyword = cache_keyword(model)
        self.last_only = {"logits_to_keep": 1} if forward_takes(model, "logits_to_keep") else {}
        self.config = inner.config

    def __call__(self, ids, mask, positions, cache) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **{self.cache_keyword: cache}, **self.last_only)
        return out.logits[:, -1, :]


def sample(model, prompt_ids: list[list[int]], settings: SamplingSettings, generator: torch.Generator,
           any_rank_running: Callable[[bool], bool] | None = None, fused: bool = True) -> Rollout:
    """Completions of `prompt_ids` (one per prompt) from `model`, in eval mode and without grad; the
    model's train/eval modes are restored after. `any_rank_running` (an all-reduce the caller
    provides) keeps the ranks of a sharded model stepping together until every rank is done.
    `fused=False` decodes through the model's own modules even where the fused decoder would run
    (what the rollouts benchmark compares it with); every rank must pass the same."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        # each rank holds the whole model: its replica samples alone (DDP's own forward would
        # broadcast the buffers, a collective every step)
        model = model.module
    try:
        with torch.no_grad():
            return _sample(model, prompt_ids, settings, generator, any_rank_running, fused)
    finally:
        for module, training in modes:
            module.training = training


def _rows_worth_dropping(finished: int, batch: int) -> bool:
    """Whether to compact the batch now: dropping rows copies the whole cache (about one step's
    attention reads), so wait until an eighth of the batch is finished rather than copy per row."""
    return finished > 0 and finished * 8 >= batch


def _distinct(prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts in order of first appearance, and for each row the index of its prompt."""
    index: dict[tuple[int, ...], int] = {}
    copy_of = [index.setdefault(tuple(p), len(index)) for p in prompt_ids]
    return [list(p) for p in index], copy_of


def _sample(model, prompt_ids, settings, generator, any_rank_running, fused: bool) -> Rollout:
    rows = len(prompt_ids)
    completions: list[list[int]] = [[] for _ in range(rows)]
    stopped = [False] * rows
    start = time.perf_counter()
    weights = None
    # FSDP2's ranks gather the weights together: each one, whatever it has to sample
    if fused and ((rows and settings.max_new_tokens > 0) or fsdp_units(model)):
        weights = decoder_weights(model, _compute_dtype(model))
    if weights is not None and rows and settings.max_new_tokens > 0:
        # no collective in a fused rollout: each rank decodes its own rows to its own end
        return _prefill_and_decode(model, _FusedSteps(weights), prompt_ids, settings, generator, None, start,
                                   completions, stopped)
    if rows == 0 or settings.max_new_tokens <= 0:
        if any_rank_running is not None and not (fused and runs_fused(model)):  # the others prefill, then decode
            _keep_step_until_all_done(model, settings.pad_token_id, any_rank_running)
        return Rollout(completions, stopped, time.perf_counter() - start, 0.0, 0)
    forward = _Forward(model)
    if getattr(forward.config, "sliding_window", None):
        # a window the masks built here do not know: the model builds its own from the 2D mask, and
        # attends with its own attention
        return _prefill_and_decode(model, _ModuleSteps(forward, "2d"), prompt_ids, settings, generator,
                                   any_rank_running, start, completions, stopped)
    with decode_attention(forward.config) as ours:
        kind = "rollout" if ours else getattr(forward.config, "_attn_implementation", None)
        return _prefill_and_decode(model, _ModuleSteps(forward, kind), prompt_ids, settings, generator,
                                   any_rank_running, start, completions, stopped)


def _compute_dtype(model) -> torch.dtype | None:
    """The dtype a forward's products run in: the autocast's under one, else the weights' (None
    under FSDP2: the dtype its mixed-precision policy gathers them in, which decoder_weights reads)."""
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None if fsdp_units(model) else next(model.parameters()).dtype


class _ModuleSteps:
    """A rollout through the model's own modules: transformers' forward over rollout_cache()."""

    path = "modules"
    decode_masks = True  # each step attends under RolloutMasks.decode()

    def __init__(self, forward: _Forward, kind: str | None):
        self.forward, self.kind = forward, kind

    def start(self, rows: int, capacity: int, padding: torch.Tensor) -> None:
        self.cache = rollout_cache(self.forward.config, capacity)

    def prefill(self, ids, positions, mask) -> torch.Tensor:
        return self.forward(ids, mask, positions, self.cache)

    def decode(self, tokens, positions, masks: RolloutMasks, seen: int) -> torch.Tensor:
        return self.forward(tokens, masks.decode(seen), positions, self.cache)

    def select_rows(self, indices: torch.Tensor) -> None:
        select_rows(self.cache, indices)


class _FusedSteps:
    """A rollout on the policy's fused weights (fused_decoder.py)."""

    kind, path = "rollout", "fused"
    decode_masks = False  # the decoder's paged cache keeps its own mask

    def __init__(self, weights):
        self.weights = weights

    def start(self, rows: int, capacity: int, padding: torch.Tensor) -> None:
        self.decoder = FusedDecoder(self.weights, rows, capacity, padding)

    def prefill(self, ids, positions, mask) -> torch.Tensor:
        return self.decoder.prefill(ids, positions, mask)

    def decode(self, tokens, positions, masks: RolloutMasks, seen: int) -> torch.Tensor:
        return self.decoder.decode(tokens, positions)  # the decoder's cache keeps its own mask

    def select_rows(self, indices: torch.Tensor) -> None:
        self.decoder.select_rows(indices)


def _prefill_and_decode(model, steps, prompt_ids, settings, generator, any_rank_running, start,
                        completions, stopped) -> Rollout:
    distinct, copy_of = _distinct(prompt_ids)
    ids, padding = _left_padded(distinct, settings.pad_token_id)
    width = ids.shape[1]
    steps.start(len(distinct), width + settings.max_new_tokens, padding)
    masks = RolloutMasks(padding, width + settings.max_new_tokens, steps.kind, next(model.parameters()).dtype)
    # positions count real tokens only, so a left-padded row sees the positions it would alone
    positions = (padding.cumsum(dim=-1) - 1).clamp(min=0)
    logits = steps.prefill(ids, positions, masks.prefill())
    if steps.decode_masks:  # rows × capacity of mask, built once, only where a step reads it
        masks.start_decoding()
    next_position = positions[:, -1:] + 1
    if len(distinct) < len(prompt_ids):  # each completion of a shared prompt gets its own copy of the cache rows
        rows_of_prompts = torch.tensor(copy_of)
        steps.select_rows(rows_of_prompts)
        masks.select_rows(rows_of_prompts)
        logits, next_position = logits[rows_of_prompts], next_position[rows_of_prompts]
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    stop = torch.tensor(settings.stop_token_ids, dtype=torch.long)
    row_of = list(range(len(prompt_ids)))  # the batch's rows → the prompts they complete
    live = torch.ones(len(prompt_ids), dtype=torch.bool)  # rows still writing; finished ones stay until compacted
    seen = width
    for step in range(1, settings.max_new_tokens + 1):
        token = next_tokens(logits, settings.temperature, settings.top_k, settings.top_p, generator)
        for index, value in zip(live.nonzero().flatten().tolist(), token[live].tolist()):
            completions[row_of[index]].append(value)
        if len(stop):
            ends = live & torch.isin(token, stop)
            for index in ends.nonzero().flatten().tolist():
                stopped[row_of[index]] = True
            live &= ~ends
        local = step < settings.max_new_tokens and bool(live.any())
        if not (any_rank_running(local) if any_rank_running is not None else local):
            break
        if not local:  # this rank is done, another is not: meet its collectives until all are done
            _keep_step_until_all_done(model, settings.pad_token_id, any_rank_running)
            break
        if _rows_worth_dropping(int((~live).sum()), len(row_of)):
            kept = live.nonzero().flatten()
            steps.select_rows(kept)
            masks.select_rows(kept)
            row_of = [row_of[i] for i in kept.tolist()]
            token, next_position, live = token[kept], next_position[kept], live[kept]
        seen += 1
        logits = steps.decode(token[:, None], next_position, masks, seen)
        next_position = next_position + 1
    return Rollout(completions, stopped, prefill_s, time.perf_counter() - start,
                   sum(len(c) for c in completions), steps.path)
