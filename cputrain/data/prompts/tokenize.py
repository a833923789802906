"""What one tokenizing process does for prompt-only records: records [start, stop) → per record its
prompt's ids (nothing trained: the completions are sampled at training time) and the record's
columns as JSON (the prompt as written, and every other column, e.g. `answer`, for the reward
functions), for the train and validation splits.

A prompt is a string, tokenized as TRL's GRPOTrainer does (with the tokenizer's special tokens), or
a conversation rendered with the chat template through the assistant's header (TRL's
add_generation_prompt). An empty prompt is skipped (skipped_empty). A prompt longer than
data.seq_len is dropped; the trainer refuses one longer than data.seq_len −
train.max_completion_length before any work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from cputrain.data import sequences
from cputrain.data.sequences import ChunkSequences, SequenceChunk, record_error
from cputrain.errors import DataError

COUNTERS = ("train_prompts", "val_prompts", "skipped_empty", "dropped_long", "trained_tokens", "val_trained_tokens",
            "text_chars", "non_text_parts", "tools_unsupported")


@dataclass(frozen=True)
class PromptSpec:
    """How records become prompts: everything that changes their tokens (the cache key hashes it)."""

    prompt_field: str
    template: str | None
    template_variables: dict
    seq_len: int

    def key(self) -> dict:
        return {"format": "prompt", **self.__dict__}


def prompt_ids(prompt, row: int) -> list[int] | str:
    """The prompt's ids, or the counter it is skipped under."""
    spec = sequences.state["spec"]
    if isinstance(prompt, str):
        if not prompt.strip():
            return "skipped_empty"
        return list(sequences.state["tokenizer"].encode(prompt, add_special_tokens=True).ids)
    if not isinstance(prompt, list):
        raise record_error(row, f"field '{spec.prompt_field}' must be a string or a list of messages "
                                f"(got {type(prompt).__name__})")
    if spec.template is None:
        raise DataError("conversational prompts are rendered with a chat template, and the tokenizer has none (nor "
                        "the built-in template's tokens); set data.chat_template to a Jinja file")
    messages = sequences.messages(prompt, row, spec.prompt_field, spec.template)
    # rendered with a stand-in answer: the ids before its first token are the prompt through the
    # assistant's header, as add_generation_prompt writes it
    answer_turns = sum(m["role"] == "assistant" for m in messages)
    ids, mask = sequences.chat_sequence(messages + [{"role": "assistant", "content": "x"}], answer_turns)
    first = mask.index(1) if 1 in mask else len(ids)
    return ids[:first]


def tokenize_rows(start: int, stop: int, held_out: np.ndarray) -> SequenceChunk:
    spec = sequences.state["spec"]
    batch = sequences.state["corpus"][start:stop]
    names = list(batch)
    out = ChunkSequences()
    kept = {"train": [], "val": []}  # each kept prompt's columns as JSON, in its split's order
    counts = dict.fromkeys(COUNTERS, 0)
    for i, is_val in enumerate(held_out):
        row = start + i
        record = {name: batch[name][i] for name in names}
        prompt = record.get(spec.prompt_field)
        if prompt is None:
            raise DataError(f"record {row + 1}: field '{spec.prompt_field}' is missing; every prompt-only record "
                            "needs one (data.prompt_field)")
        ids = sequences.record_sequences(prompt_ids, (prompt,), row, counts)
        if ids is None:
            continue
        if len(ids) > spec.seq_len:
            counts["dropped_long"] += 1
            continue
        out.add(ids, [0] * len(ids), is_val)
        split = "val" if is_val else "train"
        counts[f"{split}_prompts"] += 1
        record["prompt"] = record.pop(spec.prompt_field)
        kept[split].append(json.dumps(record, ensure_ascii=False, default=str).encode())
    chunk = out.chunk(start, stop, counts)
    for split, columns in kept.items():
        chunk.parts[f"{split}.columns.bin"] = np.frombuffer(b"".join(columns), dtype=np.uint8).copy()
        chunk.parts[f"{split}.columns_lengths.bin"] = np.asarray([len(c) for c in columns], dtype=np.uint32)
    return chunk
