"""The fused decoder's KV cache: each block's keys and values in pages of PAGE_POSITIONS positions,
every page one contiguous tensor (rows·kv-heads × positions × dim), allocated once for the rollout,
and the additive mask of what each row may attend to.

Why pages: a decode step's attention is two batched products per block over the positions written
so far. Over a slice of one long tensor, the operand is not contiguous, and torch's batched product
copies it whole first in bf16 (oneDNN's path: 0.76 ms for each block's keys and again for its
values at the demo's size) and runs slowly on it in fp32; over the whole tensor it reads positions
not written yet. Pages are contiguous and of one shape (oneDNN builds its kernel for a shape once),
and a step reads the written ones and at most one page's worth more. Measured at ~100M's shape
(64 rows × 12 heads × 64 dims, 12 blocks, positions 48 → 176, 2 threads): 30.5 ms a step fp32 and
22.0 ms bf16 in pages of 32, against 40.4 and 62.8 over exact slices and 41.7 and 24.5 over the
whole cache (pages of 16: 42.4 and 38.4; of 64: 36.8 and 34.5).
"""

from __future__ import annotations

import torch

from cputrain.rollouts.kv_cache_size import PAGE_POSITIONS


class PagedKvCache:
    def __init__(self, blocks: int, rows: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 padding: torch.Tensor):
        """`padding`: rows × prompt width, 1 on the prompts' real tokens (the left-padded prefill)."""
        pages = -(-capacity // PAGE_POSITIONS)
        shape = (rows * kv_heads, PAGE_POSITIONS, head_dim)
        # zeros, not empty: a step reads the unwritten rest of its last page (masked), and a masked
        # weight times uninitialised memory could be 0 × NaN
        self.keys = [[torch.zeros(shape, dtype=dtype) for _ in range(pages)] for _ in range(blocks)]
        self.values = [[torch.zeros(shape, dtype=dtype) for _ in range(pages)] for _ in range(blocks)]
        self.kv_heads = kv_heads
        blocked = torch.finfo(torch.float32).min
        self.mask = torch.full((rows, pages * PAGE_POSITIONS), blocked)  # fp32, additive: 0 where a row may attend
        self.mask[:, :padding.shape[1]].masked_fill_(padding.bool(), 0.0)
        self.length = 0

    def advance(self, new: int, real: bool) -> int:
        """Before a forward's blocks write their `new` positions: where they start (the positions
        written so far). A decode step's (`real`) are attended to by every row from now, the
        step's own query included; a prompt's as its padding says (set at the start)."""
        start = self.length
        if real:
            self.mask[:, start:start + new] = 0.0
        self.length += new
        return start

    def write(self, block: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values of positions start… (rows·kv-heads × new × dim)."""
        new = keys.shape[1]
        done = 0
        while done < new:
            page, offset = divmod(start + done, PAGE_POSITIONS)
            take = min(PAGE_POSITIONS - offset, new - done)
            self.keys[block][page][:, offset:offset + take] = keys[:, done:done + take]
            self.values[block][page][:, offset:offset + take] = values[:, done:done + take]
            done += take

    def prefix(self, block: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `end` positions' keys and values, contiguous (rows·kv-heads × end × dim): a prefill's."""
        pages = -(-end // PAGE_POSITIONS)
        keys = torch.cat(self.keys[block][:pages], dim=1)[:, :end]
        values = torch.cat(self.values[block][:pages], dim=1)[:, :end]
        return keys, values

    def attend(self, block: int, query: torch.Tensor, end: int, scaling: float) -> torch.Tensor:
        """One query a row (rows × heads × 1 × dim) against the first `end` positions (the new one
        written); rows × 1 × heads × dim out. The softmax runs in fp32, as eager attention's does.
        The query rows times each page's keys transposed: at ~100M (bf16, 2 threads) 6.9 ms a step
        for the scores against 10.2 ms the other way round (fp32 the same either way)."""
        rows, heads, _, dim = query.shape
        group = heads // self.kv_heads  # grouped-query attention: a kv head's query heads share one product
        pages = -(-end // PAGE_POSITIONS)
        q = query.reshape(rows * self.kv_heads, group, dim)
        scores = torch.cat([torch.bmm(q, page.transpose(1, 2)) for page in self.keys[block][:pages]], dim=-1)
        width = pages * PAGE_POSITIONS
        scores = scores.view(rows, heads, width).float() * scaling + self.mask[:, None, :width]
        weights = scores.softmax(dim=-1).to(query.dtype).view(rows * self.kv_heads, group, width)
        values = self.values[block]
        out = torch.bmm(weights[..., :PAGE_POSITIONS], values[0])
        for page in range(1, pages):
            out = torch.baddbmm(out, weights[..., page * PAGE_POSITIONS:(page + 1) * PAGE_POSITIONS], values[page])
        return out.view(rows, heads, 1, dim).transpose(1, 2)

    def select_rows(self, indices: torch.Tensor) -> None:
        """Only the rows `indices` stay, in their order (repeats allowed)."""
        kv_indices = (indices[:, None] * self.kv_heads + torch.arange(self.kv_heads)).flatten()
        self.keys = [[page.index_select(0, kv_indices) for page in pages] for pages in self.keys]
        self.values = [[page.index_select(0, kv_indices) for page in pages] for pages in self.values]
        self.mask = self.mask.index_select(0, indices)
