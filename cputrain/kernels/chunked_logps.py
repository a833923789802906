"""Each target token's log-probability through the head, a block of tokens at a time: what
preference objectives (DPO, SimPO, KTO) and online RL read, without the logits of the whole
micro-batch.

The plain path (objectives.preference_loss.sequence_logps on the model's logits) holds the
logits, their fp32 copy, the log-softmax and its gradient: three to four tokens × vocabulary × 4
bytes (Llama-3's 128,256 tokens × 2,048 tokens: 1 GiB each). Here, as in chunked_loss.py, each
block's logits live only inside the forward, which also works out the gradient of every token's
log-probability with respect to the hidden states (one row per token) and, for a trained head,
to the logits (in the compute dtype, transposed, for one weight-gradient matmul). The loss reads
the log-probabilities per sequence, so unlike the language-model loss the gradient reaching each
token differs: the backward scales those rows by it, then does the weight's matmul.

    logp_t = logit_t[y_t] - logsumexp(logit_t)
    d logp_t / d logit_t = one_hot(y_t) - softmax(logit_t)

Online RL (GRPO, RLOO) reads each completion token's log-probability at the sampling temperature T
(the logits divided by T, as TRL takes them) from the position that predicts it, which in a row
sharing its prompt is not always the one before it (cputrain.objectives.rollout_batch): those
positions' hidden states are gathered first (picked_logps), then go through the same blocks with
every logit scaled by 1/T, and its gradient by 1/T again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from cputrain.kernels.chunked_loss import IGNORE_INDEX, block_rows, head_blocks


@dataclass
class TokenLogpsOutput(ModelOutput):
    """What the model returns when asked for token_logps (kernels/chunked_head.install_chunked_loss)."""

    token_logps: torch.Tensor | None = None


class _ChunkedTokenLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int,
                temperature: float = 1.0):
        needs_hidden, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        logps = torch.zeros(hidden.shape[0], dtype=torch.float32)
        # d logp_t / d hidden_t, one row per token; and d logp_t / d logits, vocab × tokens (the
        # layout of chunked_loss.py: the weight's gradient is then one contiguous matmul)
        unit_hidden = torch.empty_like(hidden) if needs_hidden else None
        unit_logits_t = torch.empty(weight.shape[0], hidden.shape[0], dtype=hidden.dtype) if needs_weight else None
        for block in head_blocks(hidden, weight, targets, rows, 1.0 / temperature):
            logps[block.rows] = (block.picked - block.lse) * block.valid
            if not (needs_hidden or needs_weight):
                continue
            # d logp / d logits = (one_hot - softmax) / T: the cross-entropy's gradient, negated and
            # through the division by the temperature; an untrained position passes none
            g = block.nll_grad(-1.0 / temperature).to(hidden.dtype)
            if needs_hidden:
                unit_hidden[block.rows] = g @ weight
            if needs_weight:
                unit_logits_t[:, block.rows] = g.t()
        ctx.save_for_backward(hidden if needs_weight else None, unit_hidden, unit_logits_t)
        return logps

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor):
        hidden, unit_hidden, unit_logits_t = ctx.saved_tensors
        grad_hidden = grad_weight = None
        # in place: the saved rows are read by this one backward only (no retain_graph in training),
        # and a scaled copy of the vocab × tokens one would double the head's largest tensor
        if unit_hidden is not None:
            grad_hidden = unit_hidden.mul_(grad_logps.to(unit_hidden.dtype)[:, None])
        if unit_logits_t is not None:
            grad_weight = unit_logits_t.mul_(grad_logps.to(unit_logits_t.dtype)[None, :]) @ hidden
        return grad_hidden, grad_weight, None, None, None


def chunked_token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[rows, tokens] log-probability of each next-token label (labels[:, t+1] from hidden[:, t]),
    0 where that label is -100 and at each row's last position: what sequence_logps gathers from
    the log-softmax of the logits, with the same gradients."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # token t predicts t+1
    return _token_logps(hidden.reshape(-1, hidden.shape[-1]), weight, shifted.reshape(-1), 1.0).reshape(labels.shape)


@dataclass
class PickedPositions:
    """Which positions' log-probabilities a forward returns (online RL): `targets[i, j]` predicted
    from row `rows[i]`, position `positions[i, j]`, IGNORE_INDEX where there is none (0 returned),
    the logits divided by `temperature`."""

    rows: torch.Tensor  # [completions]
    positions: torch.Tensor  # [completions, longest completion]
    targets: torch.Tensor  # [completions, longest completion]
    temperature: float


def picked_logps(hidden: torch.Tensor, weight: torch.Tensor, picked: PickedPositions) -> torch.Tensor:
    """[completions, longest completion] log-probability of each target at the temperature, from the
    hidden states [rows, tokens, d] of the positions that predict them; 0 where the target is
    IGNORE_INDEX. Only those positions go through the head."""
    at = positions_of(hidden, picked.rows, picked.positions)  # [completions, longest, d]: a hidden-sized copy
    logps = _token_logps(at.reshape(-1, at.shape[-1]), weight, picked.targets.reshape(-1), picked.temperature)
    return logps.reshape(picked.targets.shape)


def positions_of(x: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [rows, tokens, n] at `positions` [completions, longest] of each completion's row `rows`
    [completions]: [completions, longest, n], as x[rows[:, None], positions], whose backward is
    not repeatable. Positions repeat (a shared row's completions are all predicted first from the
    prompt's last position), and that indexing's backward adds their gradients with atomic adds
    on several threads, so in an order that changes from run to run: two runs of make demo-grpo
    parted at step 3 or 4 on 2 threads, never on one. index_select's backward adds them in order."""
    flat = rows[:, None] * x.shape[1] + positions
    return x.reshape(-1, x.shape[-1]).index_select(0, flat.reshape(-1)).view(*positions.shape, x.shape[-1])


def _token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """[tokens] log-probability of each target from hidden [tokens, d], in the compute dtype:
    autocast's, else the hidden states'."""
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else hidden.dtype
    with torch.autocast("cpu", enabled=False):
        return _ChunkedTokenLogps.apply(hidden.to(dtype), weight.to(dtype), targets, block_rows(weight.shape[0]),
                                        temperature)
