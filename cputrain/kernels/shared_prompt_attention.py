"""Attention for online RL's rows that share a prompt, a completion at a time: each completion's
queries against its prompt's keys and its own, the prompt's queries against the prompt, and no
attention between positions that the row's mask would throw away.

Why: a row laid out as [prompt | completion 1 | … | completion k] (cputrain.objectives.rollout_batch)
carries a W × W mask under which a completion sees its prompt and itself only. Eager attention, and
torch's CPU flash kernel given a mask, compute every one of the W² query-key pairs and throw most
away: at the GRPO benchmark's ~100M shape (rows of 211 positions: a 17-token prompt and 4
completions of 48) the step needs ~4× fewer than the row holds, and the throwaway was ~0.75 s of a
23 s step (docs/benchmarks/online-rl.md). Here the completions are gathered into a batch of their
own, [completions, heads, longest completion, dim], against [its prompt's keys | its own], a
mask of that size; the prompts as a causal batch of the rows' first positions. The results go back
to the rows' positions; the padding after a row's last completion gets zeros (nothing reads it).

The products run in the kernel the run chose (model.attn_implementation: sdpa or eager). The
gathers are copies of the queries, keys and values (about 1 + 2 × (prompt + completion) ÷
completion times a block's queries), made once a block in the forward and summed back in the
backward.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cputrain.kernels.attention_swap import swapped_attention

NAME = "cputrain_shared_prompt"


@dataclass
class SharedPromptLayout:
    """Where a micro-batch's completions and prompts sit in its rows [rows, width]: flat indices
    into rows × width. Built once a forward (shared_prompt_layout), read by every block."""

    rows: int
    width: int
    prompt_width: int  # the longest prompt: the prompts' batch is the rows' first this many positions
    completion_at: torch.Tensor  # [completions, longest] each token's flat position (its first where past its end)
    prompt_at: torch.Tensor  # [completions, prompt_width] its prompt's flat positions (the row's first ones)
    allowed: torch.Tensor  # [completions, 1, longest, prompt_width + longest] bool: the key a query sees
    written: torch.Tensor  # [completions, longest] bool: a real completion token (its output goes back)
    kernel: str  # "sdpa" or "eager"


def shared_prompt_layout(completion_rows: torch.Tensor, completion_starts: torch.Tensor, lengths: torch.Tensor,
                         prompt_lengths: torch.Tensor, rows: int, width: int, kernel: str) -> SharedPromptLayout:
    """The layout of completions `completion_rows` [n] starting at row positions `completion_starts`,
    `lengths` tokens long, after prompts of `prompt_lengths` at the start of their rows."""
    longest = max(int(lengths.max()), 1)
    prompt_width = int(prompt_lengths.max())
    j = torch.arange(longest)
    written = j[None, :] < lengths[:, None]
    base = completion_rows[:, None] * width
    completion_at = base + completion_starts[:, None] + torch.where(written, j[None, :], 0)
    prompt_at = base + torch.arange(prompt_width)[None, :]
    sees_prompt = torch.arange(prompt_width)[None, :] < prompt_lengths[:, None]  # [n, prompt_width]
    causal = j[None, :, None] >= j[None, None, :]  # [1, longest, longest]
    sees_own = causal & written[:, None, :]
    allowed = torch.cat([sees_prompt[:, None, :].expand(-1, longest, -1), sees_own], dim=-1)[:, None]
    return SharedPromptLayout(rows, width, prompt_width, completion_at, prompt_at, allowed, written, kernel)


def _products(query, key, value, allowed, scaling: float, kernel: str, dropout: float,
              causal: bool = False) -> torch.Tensor:
    """[batch, heads, queries, dim] attention of `query` over `key`/`value` ([batch, kv-heads, keys,
    dim]) where `allowed` [batch, 1, queries, keys] (or causal), in the run's kernel, with the
    attention dropout transformers hands a training forward (0 for Llama)."""
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=None if causal else allowed,
                                              dropout_p=dropout, is_causal=causal, scale=scaling,
                                              enable_gqa=key.shape[1] != query.shape[1])
    groups = query.shape[1] // key.shape[1]  # eager: transformers' math, keys and values repeated per group
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    if causal:
        n = scores.shape[-1]
        allowed = torch.ones(n, n, dtype=torch.bool).tril_()
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return F.dropout(weights, p=dropout, training=dropout > 0) @ value


def shared_prompt_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            shared_prompt: SharedPromptLayout | None = None, **kwargs):
    """transformers' attention-function signature (query [rows, heads, width, dim], keys and values
    [rows, kv-heads, width, dim]); returns [rows, width, heads, dim] as transformers' kernels do.
    `shared_prompt` comes through the model's forward keywords."""
    lay = shared_prompt
    rows, heads, width, dim = query.shape
    kv_heads = key.shape[1]
    scaling = scaling if scaling is not None else 1 / math.sqrt(dim)
    # positions first, then heads: a gather over rows × width picks whole positions
    flat_q = query.transpose(1, 2).reshape(rows * width, heads, dim)
    flat_k = key.transpose(1, 2).reshape(rows * width, kv_heads, dim)
    flat_v = value.transpose(1, 2).reshape(rows * width, kv_heads, dim)
    n, longest = lay.completion_at.shape

    def gathered(flat, at):  # [n, heads, positions, dim]
        return flat.index_select(0, at.reshape(-1)).view(n, at.shape[1], flat.shape[1], dim).transpose(1, 2)

    q = gathered(flat_q, lay.completion_at)
    k = torch.cat([gathered(flat_k, lay.prompt_at), gathered(flat_k, lay.completion_at)], dim=2)
    v = torch.cat([gathered(flat_v, lay.prompt_at), gathered(flat_v, lay.completion_at)], dim=2)
    completions = _products(q, k, v, lay.allowed, scaling, lay.kernel, dropout)  # [n, heads, longest, dim]
    p = lay.prompt_width
    prompts = _products(query[:, :, :p], key[:, :, :p], value[:, :, :p], None, scaling, lay.kernel, dropout,
                        causal=True)
    out = torch.zeros(rows, width, heads, dim, dtype=completions.dtype)
    # the prompts' first: a row with a shorter prompt has completion tokens among its first p, and
    # the completions' outputs, written after, replace them
    out[:, :p] = prompts.transpose(1, 2).to(out.dtype)
    written = lay.written.reshape(-1)
    out.view(rows * width, heads, dim).index_put_(  # in place: no second copy of the block's outputs
        (lay.completion_at.reshape(-1)[written],), completions.transpose(1, 2).reshape(-1, heads, dim)[written])
    return out, None


@contextmanager
def shared_prompt_kernel(config):
    """For the block: the model `config` describes attends through shared_prompt_attention, where
    it attends through sdpa or eager and this transformers has the interfaces; yields the kernel it
    follows (None: the model's own attention runs, and the caller passes the row mask). No mask is
    built: the layout is the mask."""
    with swapped_attention(config, NAME, shared_prompt_attention, _no_mask) as before:
        yield before


def _no_mask(*args, **kwargs):
    return None
