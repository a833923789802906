"""A rollout whose forward is llama.cpp's (through llama-cpp-python's C API) and whose sampling is
cputrain's own (cputrain.rollouts.token_draw, the same generator): what the rollout would be if
cputrain handed its decoder to llama.cpp. For the llama_cpp_rollout benchmark only; cputrain's own
path never imports llama.cpp.

The batch is decoded the way llama.cpp's batched examples do: each row its own sequence, in its
own KV stream (kv_unified off, so a row's attention reads its own positions only), the distinct
prompts prefilled once in one llama_decode and copied to their other rows (llama_memory_seq_cp),
then one llama_decode a step with one token a row, every row's logits out.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

_silenced = None  # the log callback llama.cpp holds: kept alive here, or it is collected under it


def _quiet(llama_cpp) -> None:
    global _silenced
    if _silenced is None:
        _silenced = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_silenced, ctypes.c_void_p())


class LlamaCppModel:
    """One GGUF file loaded (memory-mapped) by llama.cpp."""

    def __init__(self, path: str, threads: int):
        import llama_cpp

        self.lib = llama_cpp
        _quiet(llama_cpp)
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.threads = threads

    def close(self) -> None:
        self.lib.llama_model_free(self.model)

    def _logits(self, ctx, rows: int) -> torch.Tensor:
        pointer = self.lib.llama_get_logits(ctx)
        return torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(rows, self.vocab)).copy())

    def rollout(self, prompts: list[list[int]], new_tokens: int, generator: torch.Generator) -> dict:
        """Plain sampling (temperature 1), every row to `new_tokens`: tokens/s, the prefill's
        seconds (the context built included) and a decode step's, and llama_decode's share of it."""
        from cputrain.rollouts.token_draw import next_tokens

        lib, rows = self.lib, len(prompts)
        start = time.perf_counter()
        params = lib.llama_context_default_params()
        params.n_seq_max = rows
        params.n_ctx = rows * (max(len(p) for p in prompts) + new_tokens)
        params.n_batch = max(sum(len(p) for p in set(map(tuple, prompts))), rows)
        params.n_ubatch = min(params.n_batch, 512)
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = False
        params.no_perf = True
        ctx = lib.llama_init_from_model(self.model, params)
        batch = lib.llama_batch_init(params.n_batch, 0, rows)
        try:
            first_row: dict[tuple[int, ...], int] = {}
            for row, prompt in enumerate(prompts):
                first_row.setdefault(tuple(prompt), row)
            count = 0
            for prompt, seq in first_row.items():
                for position, token in enumerate(prompt):
                    batch.token[count], batch.pos[count], batch.n_seq_id[count] = token, position, 1
                    batch.seq_id[count][0], batch.logits[count] = seq, position == len(prompt) - 1
                    count += 1
            batch.n_tokens = count
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed on the prefill")
            prefilled = self._logits(ctx, len(first_row))
            output_of = {seq: i for i, seq in enumerate(first_row.values())}
            memory = lib.llama_get_memory(ctx)
            sources = [first_row[tuple(p)] for p in prompts]
            for row, source in enumerate(sources):
                if source != row:
                    lib.llama_memory_seq_cp(memory, source, row, -1, -1)
            logits = prefilled[[output_of[s] for s in sources]]
            prefill_s = time.perf_counter() - start
            start = time.perf_counter()
            positions = [len(p) for p in prompts]
            decode_call_s = 0.0
            for step in range(new_tokens):
                tokens = next_tokens(logits, 1.0, 0, 1.0, generator).tolist()
                if step == new_tokens - 1:
                    break
                for row, token in enumerate(tokens):
                    batch.token[row], batch.pos[row], batch.n_seq_id[row] = token, positions[row], 1
                    batch.seq_id[row][0], batch.logits[row] = row, True
                    positions[row] += 1
                batch.n_tokens = rows
                called = time.perf_counter()
                if lib.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed on a decode step")
                decode_call_s += time.perf_counter() - called
                logits = self._logits(ctx, rows)
            decode_s = time.perf_counter() - start
        finally:
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)
        steps = max(new_tokens - 1, 1)
        return {"tokens_per_s": rows * new_tokens / (prefill_s + decode_s), "prefill_s": prefill_s,
                "decode_step_s": decode_s / steps, "decode_call_share": decode_call_s / decode_s if decode_s else 0.0}
