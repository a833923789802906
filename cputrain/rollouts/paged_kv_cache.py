"""The fused decoder's KV cache: each block's prompt keys and values held once per distinct prompt,
the generated positions' in pages of PAGE_POSITIONS positions, every page one contiguous tensor
(rows·kv-heads × positions × dim), and the additive mask of what each row may attend to.

Why the prompts once: GRPO and RLOO sample several completions of each prompt, and a decode step's
attention is bound by reading the cache. Each prompt's keys and values are read once for all of its
rows, one batched product with the rows of the prompt as its rows, where a copy per row would be read
once per row. That holds while every prompt has the same number of rows, one after another (how
sample() lays out a group of generations); when rows are dropped or the rows come in another order,
the prompt part is copied out to each row (what every row held before), and attention goes on as a
copy per row.

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
        """`rows` prompts, left-padded to `padding`'s width (rows × width, 1 on real tokens), prefilled
        into the prompt part; `capacity`: that width plus the positions decoding may write."""
        self.width = padding.shape[1]
        prompt_shape = (rows * kv_heads, self.width, head_dim)
        self.prompt_keys = [torch.zeros(prompt_shape, dtype=dtype) for _ in range(blocks)]
        self.prompt_values = [torch.zeros(prompt_shape, dtype=dtype) for _ in range(blocks)]
        self.rows_per_prompt = 1  # each prompt's rows follow one another, this many each (1: a copy a row)
        self.pages = -(-(capacity - self.width) // PAGE_POSITIONS)
        self.keys: list[list[torch.Tensor]] = []  # [block][page], allocated at the first decode step's rows
        self.values: list[list[torch.Tensor]] = []
        self.blocks, self.kv_heads, self.head_dim, self.dtype = blocks, kv_heads, head_dim, dtype
        blocked = torch.finfo(torch.float32).min
        self.mask = torch.full((rows, self.width + self.pages * PAGE_POSITIONS), blocked)  # fp32, additive
        self.mask[:, :self.width].masked_fill_(padding.bool(), 0.0)
        self.length = 0

    def advance(self, new: int, real: bool) -> int:
        """Before a forward's blocks write their `new` positions: where they start (the positions
        written so far). A decode step's (`real`) are attended to by every row from now, the
        step's own query included; a prompt's as its padding says (set at the start)."""
        start = self.length
        if real:
            self.mask[:, start:start + new] = 0.0
            if not self.keys:
                # zeros, not empty: a step reads the unwritten rest of its last page (masked), and a
                # masked weight times uninitialised memory could be 0 × NaN
                shape = (self.mask.shape[0] * self.kv_heads, PAGE_POSITIONS, self.head_dim)
                self.keys = [[torch.zeros(shape, dtype=self.dtype) for _ in range(self.pages)]
                             for _ in range(self.blocks)]
                self.values = [[torch.zeros(shape, dtype=self.dtype) for _ in range(self.pages)]
                               for _ in range(self.blocks)]
        self.length += new
        return start

    def write(self, block: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keys and values of positions start… (rows·kv-heads × new × dim): the whole prompt part
        at once (the prefill), or generated positions."""
        new = keys.shape[1]
        if start < self.width:
            assert start == 0 and new == self.width, "a prefill writes the prompt part whole"
            self.prompt_keys[block].copy_(keys)
            self.prompt_values[block].copy_(values)
            return
        done = 0
        while done < new:
            page, offset = divmod(start - self.width + done, PAGE_POSITIONS)
            take = min(PAGE_POSITIONS - offset, new - done)
            self.keys[block][page][:, offset:offset + take] = keys[:, done:done + take]
            self.values[block][page][:, offset:offset + take] = values[:, done:done + take]
            done += take

    def prefix(self, block: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt part's keys and values (rows·kv-heads × width × dim): a prefill's."""
        assert end == self.width, "only the prefill attends through prefix()"
        return self.prompt_keys[block], self.prompt_values[block]

    def _by_prompt(self, x: torch.Tensor, inner: int) -> torch.Tensor:
        """rows × kv-heads × `inner` × n (row-major) → prompts·kv-heads × rows-per-prompt·`inner` × n."""
        group = self.rows_per_prompt
        if group == 1:
            return x.reshape(-1, inner, x.shape[-1])
        rows, n = x.shape[0], x.shape[-1]
        return (x.reshape(rows // group, group, self.kv_heads, inner, n).transpose(1, 2)
                .reshape(-1, group * inner, n))

    def _by_row(self, x: torch.Tensor, inner: int) -> torch.Tensor:
        """_by_prompt's inverse: prompts·kv-heads × rows-per-prompt·`inner` × n → rows·kv-heads × `inner` × n."""
        group = self.rows_per_prompt
        if group == 1:
            return x
        n = x.shape[-1]
        return (x.reshape(-1, self.kv_heads, group, inner, n).transpose(1, 2)
                .reshape(-1, inner, n))

    def attend(self, block: int, query: torch.Tensor, end: int, scaling: float) -> torch.Tensor:
        """One query a row (rows × heads × 1 × dim) against the first `end` positions (the new one
        written); rows × 1 × heads × dim out. The softmax runs in fp32, as eager attention's does.
        The query rows times the keys transposed: at ~100M (bf16, 2 threads) 6.9 ms a step for
        the scores against 10.2 ms the other way round (fp32 the same either way)."""
        rows, heads, _, dim = query.shape
        group = heads // self.kv_heads  # grouped-query attention: a kv head's query heads share one product
        pages = -(-(end - self.width) // PAGE_POSITIONS)
        q = query.reshape(rows, self.kv_heads, group, dim)
        prompt_scores = self._by_row(torch.bmm(self._by_prompt(q, group), self.prompt_keys[block].transpose(1, 2)),
                                     group)
        q = q.reshape(rows * self.kv_heads, group, dim)
        scores = torch.cat([prompt_scores] + [torch.bmm(q, page.transpose(1, 2)) for page in self.keys[block][:pages]],
                           dim=-1)
        width = self.width + pages * PAGE_POSITIONS
        # mask + scaling · scores in one fp32 pass (the bf16 scores are widened inside it, not first)
        scores = torch.add(self.mask[:, None, :width], scores.view(rows, heads, width), alpha=scaling)
        weights = scores.softmax(dim=-1).to(query.dtype).view(rows, self.kv_heads, group, width)
        out = self._by_row(torch.bmm(self._by_prompt(weights[..., :self.width], group), self.prompt_values[block]),
                           group)
        weights = weights.view(rows * self.kv_heads, group, width)
        for page, values in enumerate(self.values[block][:pages]):
            start = self.width + page * PAGE_POSITIONS
            out = torch.baddbmm(out, weights[..., start:start + PAGE_POSITIONS], values)
        return out.view(rows, heads, 1, dim).transpose(1, 2)

    def select_rows(self, indices: torch.Tensor) -> None:
        """Only the rows `indices` stay, in their order (repeats allowed). Where each prompt is then
        held by the same number of rows, one after another, its prompt part stays shared."""
        prompts = self.prompt_keys[0].shape[0] // self.kv_heads
        prompt_of = torch.arange(prompts).repeat_interleave(self.rows_per_prompt)[indices]  # each kept row's prompt
        group = len(indices) // prompts if prompts and len(indices) % prompts == 0 else 0
        if group and torch.equal(prompt_of, torch.arange(prompts).repeat_interleave(group)):
            self.rows_per_prompt = group
        else:  # the prompt part copied out to each row
            kv_rows = self._kv_rows(prompt_of)
            self.prompt_keys = [keys.index_select(0, kv_rows) for keys in self.prompt_keys]
            self.prompt_values = [values.index_select(0, kv_rows) for values in self.prompt_values]
            self.rows_per_prompt = 1
        kv_rows = self._kv_rows(indices)
        self.keys = [[page.index_select(0, kv_rows) for page in pages] for pages in self.keys]
        self.values = [[page.index_select(0, kv_rows) for page in pages] for pages in self.values]
        self.mask = self.mask.index_select(0, indices)

    def _kv_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows[:, None] * self.kv_heads + torch.arange(self.kv_heads)).flatten()
