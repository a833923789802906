"""Which completions of an online-RL micro-batch share a row: their prompt laid out once, each
completion after it (cputrain.objectives.rollout_batch), where that costs fewer FLOPs.

GRPO and RLOO sample num_generations completions a prompt; laid out one a row, a group's prompt is
computed num_generations times. At the GRPO benchmark's ~100M Llama (12 layers, hidden 768, 8
generations of ≤48 tokens after ~17-token prompts) prompts are ~23% of the positions; reasoning
prompts of hundreds of tokens make it far more. Sharing saves each repeated prompt position's
linear work (2 × the blocks' matmul parameters a position, forward). What it costs in attention
depends on how a shared row is attended:
- a completion at a time (cputrain.kernels.shared_prompt_attention, under sdpa and eager): each
  completion's longest × (prompt + longest) query-key pairs, masked, and the prompts' causal ones;
  no width² tensor. The widest row holds no more positions than one completion a row would.
- under the row's mask (any other kernel): every pair of the row, its width squared, and a W² mask in
  the batch and again as the additive one every layer reads (cputrain.data.batch.attention_mask_for).
  A row is then at most WIDTH_CAP × data.seq_len wide: a group's completions spill into more rows,
  each with the prompt, and the quadratic part stays 16 × seq_len² a row.
The estimate below (a training step's FLOPs by cputrain.metrics.flops, the run's MFU count, from the
model's config, padding included) is taken for one completion a row and for at most 2, 3, … a row;
the cheapest is kept if it holds no more positions than one a row and no more query-key pairs than
micro-batch × data.seq_len², so the memory plan's activations (micro-batch × data.seq_len positions,
and under eager attention a matrix of that many pairs a block) and the one mask it plans for rows
that carry one (cputrain.plan.memory.activations.attention_mask_bytes) still bound it.

Its figures, a completion at a time: at that 100M shape (data.seq_len 128) a group of 8 in one row
(401 wide), 19.6% fewer FLOPs than one a row (under the row's mask: 4 a row, 15.1%); an 8B run at
seq_len 2,048 with 16 × 1,024-token completions after a 500-token prompt, the group in one row
(16,884 wide), 27.6% fewer (under the row's mask: 2 a row, 10%); after a 5-token prompt nothing is
shared (it would cost 5.9% more: a masked completion's pairs are not halved as a causal row's are).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cputrain.kernels.attention_swap import FOLLOWS
from cputrain.metrics.flops import flops_per_token
from cputrain.rollouts.decoder_sizes import config_field, decoder_sizes

WIDTH_CAP = 4  # a shared row's width, at most this many data.seq_len


@dataclass(frozen=True)
class RowChoice:
    rows: list[list[int]] | None  # the completions of each row; None: one a row
    shared_flops: float  # the estimated training FLOPs of the micro-batch: the cheapest shared layout's, one a row's
    unshared_flops: float
    shared_positions: int  # rows × width of each layout
    unshared_positions: int
    most: int  # the cheapest shared layout's completions a row, at most
    width: int  # and its widest row
    cap: int

    def described(self) -> str:
        saving = 1 - self.shared_flops / max(self.unshared_flops, 1.0)
        verdict = "shared" if self.rows is not None else "not shared"
        return (f"each group's prompt {verdict} in the training rows (first micro-batch: an estimated "
                f"{self.shared_flops / 1e12:.3g} TFLOP forward and backward with up to {self.most} completions a row against "
                f"{self.unshared_flops / 1e12:.3g} with one, {abs(saving):.1%} {'fewer' if saving >= 0 else 'more'}; {self.shared_positions} positions against "
                f"{self.unshared_positions}; widest shared row {self.width} of at most {self.cap})")


def causal_pairs(config, width: int) -> float:
    """Query-key pairs a causal row of `width` computes: causal sdpa skips the upper half, eager not."""
    return width * (width + 1) / 2 if config_field(config, "_attn_implementation", "sdpa") != "eager" else width * width


def segment_attention(config) -> bool:
    """Whether shared rows attend a completion at a time (kernels/shared_prompt_attention.py: the
    run's kernel is one it follows) rather than under the row's mask."""
    return config_field(config, "_attn_implementation", "sdpa") in FOLLOWS


def layout_flops(config, rows: int, width: int, first: int, pairs: float) -> float:
    """A training step's FLOPs (forward and backward, cputrain.metrics.flops) over `rows` rows of
    `width` positions, the head from position `first` on (logits_to_keep): the blocks' matmuls,
    attention over the `pairs` query-key pairs computed in all, the head."""
    s = decoder_sizes(config)
    blocks = flops_per_token(s.layers * s.block_matmul_params, s.layers, s.hidden, pairs / (rows * width))
    head = flops_per_token(s.hidden * s.vocab, 0, s.hidden, 0)
    return rows * (width * blocks + (width - first) * head)


def shared_pairs(config, prompt_ids: list[list[int]], completion_ids: list[list[int]], rows: list[list[int]],
                 width: int) -> float:
    """Query-key pairs of a shared layout. A completion at a time (segment_attention): the prompts'
    causal rows of the longest prompt, and each completion's longest × (prompt + longest), masked;
    under the row's mask, every pair of every row."""
    if not segment_attention(config):
        return len(rows) * width * width
    longest = max(len(c) for c in completion_ids)
    prompt = max(len(prompt_ids[r[0]]) for r in rows)
    return len(rows) * causal_pairs(config, prompt) + len(completion_ids) * longest * (prompt + longest)


def grouped(prompt_ids: list[list[int]], completion_ids: list[list[int]], cap: int,
            most: int | None = None) -> list[list[int]]:
    """Consecutive completions of one prompt (a group, or the part of it in this micro-batch) in
    one row, at most `most` of them, spilling into another where the row would pass `cap` positions."""
    rows: list[list[int]] = []
    width = 0
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        if (rows and prompt_ids[rows[-1][0]] == prompt and width + len(completion) <= cap
                and len(rows[-1]) < (most or cap)):
            rows[-1].append(i)
            width += len(completion)
        else:
            rows.append([i])
            width = len(prompt) + len(completion)
    return rows


def row_choice(config, prompt_ids: list[list[int]], completion_ids: list[list[int]], seq_len: int | None) -> RowChoice:
    """The micro-batch's rows: of the shared layouts with 2, 3, … completions a row at most (a row
    of a few long completions may pay where one of all does not), the cheapest by the estimate
    among those holding no more positions than one a row and no more query-key pairs than the
    memory plan's micro-batch × data.seq_len²; shared where it is cheaper than one a row. `seq_len`: data.seq_len (None: the micro-batch's longest prompt + completion)."""
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    first = min(len(p) for p in prompt_ids) - 1
    positions = len(lengths) * max(lengths)
    # a completion at a time, a row holds no width × width tensor: its positions bound it (below);
    # under the row's mask, WIDTH_CAP bounds the mask
    cap = positions if segment_attention(config) else WIDTH_CAP * max(seq_len or 0, *lengths)
    # the memory plan's attention matrices (eager): micro-batch × data.seq_len² a block
    squares = len(lengths) * max(seq_len or 0, *lengths) ** 2
    unshared = layout_flops(config, len(lengths), max(lengths), first,
                            len(lengths) * causal_pairs(config, max(lengths)))
    best = RowChoice(None, unshared, unshared, positions, positions, 1, max(lengths), cap)
    for most in range(2, len(lengths) + 1):
        rows = grouped(prompt_ids, completion_ids, cap, most)
        if len(rows) == len(lengths):  # no two neighbours share a prompt
            break
        width = max(len(prompt_ids[r[0]]) + sum(len(completion_ids[i]) for i in r) for r in rows)
        pairs = shared_pairs(config, prompt_ids, completion_ids, rows, width)
        flops = layout_flops(config, len(rows), width, first, pairs)
        fits = len(rows) * width <= positions and pairs <= squares
        if fits and (best.most == 1 or flops < best.shared_flops):
            best = RowChoice(rows, flops, unshared, len(rows) * width, positions, most, width, cap)
        if max(len(r) for r in rows) < most:  # no row reached `most`: more would lay out the same
            break
    return best if best.shared_flops < unshared else dataclasses.replace(best, rows=None)
