"""What one tokenizing process does for chat and prompt/completion records: records [start, stop)
→ token ids, a trained-token mask and example lengths, for the train and validation splits.

A chat record is rendered with the chat template and its assistant turns found as character
spans of the rendering (cputrain.data.chat_template); a token is trained when it starts inside
one. A prompt/completion record is the tokens of prompt + completion (with the tokenizer's BOS, if it
adds one), then EOS; the completion and EOS are trained, from where the prompt's own tokens end. The token that ends
each trained answer is trained: without it the model never learns to stop.
Like tokenize_chunk, a worker opens the Arrow files itself and needs no torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from cputrain.data.chat_template import ROLES, assistant_spans
from cputrain.data.tokenize_chunk import REMAP_EVERY_CHARS, open_arrow
from cputrain.errors import DataError

_state: dict = {}  # set once per process by init_worker


@dataclass(frozen=True)
class ExampleSpec:
    """How records become examples: everything that changes the tokens or the mask (the cache key
    hashes it)."""

    format: str  # chat | prompt_completion
    messages_field: str
    prompt_field: str
    completion_field: str
    train_on: str  # assistant | completion | all
    template: str | None  # the chat template's text (chat only)
    template_variables: dict = field(default_factory=dict)  # bos_token, eos_token … as the template sees them
    seq_len: int = 0
    truncation: str = "drop"

    def key(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


# the counters a chunk reports, summed into stats.json
COUNTERS = ("train_examples", "val_examples", "no_answer", "dropped_long", "truncated", "trained_tokens",
            "val_trained_tokens", "text_chars")


@dataclass
class ExampleChunk:
    start: int
    stop: int
    parts: dict  # stream file name → array: train.bin / .mask.bin / .lengths.bin, and val.*
    counts: dict


def init_worker(arrow_files: list[str] | None, dataset, spec: ExampleSpec, tokenizer_json: str, eos_id: int,
                dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    from tokenizers import Tokenizer

    _state.update(files=arrow_files, dataset=dataset if arrow_files is None else open_arrow(arrow_files), spec=spec,
                  tokenizer=Tokenizer.from_str(tokenizer_json), eos=eos_id, dtype=np.dtype(dtype), chars_since_open=0)


def _record_error(row: int, what: str) -> DataError:
    return DataError(f"record {row + 1}: {what}")


def _messages(value, row: int, name: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _record_error(row, f"field '{name}' must be a non-empty list of {{role, content}} messages; "
                                 "set data.messages_field to the field that holds them")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise _record_error(row, f"every message needs a 'role' and a string 'content' (got {str(m)[:80]})")
        if m["role"] not in ROLES:
            raise _record_error(row, f"unknown role '{m['role']}'; the roles are {', '.join(ROLES)}")
        if m["role"] == "assistant" and not m["content"].strip():
            raise _record_error(row, "an assistant turn is empty: nothing to learn from it; fill or remove it")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _chat_example(value, row: int) -> tuple[list[int], list[int]] | None:
    s = _state
    spec = s["spec"]
    messages = _messages(value, row, spec.messages_field)
    if not any(m["role"] == "assistant" for m in messages):
        return None  # nothing to train on: skipped and counted
    text, spans = assistant_spans(spec.template, messages, spec.template_variables)
    enc = s["tokenizer"].encode(text, add_special_tokens=False)  # the template writes any BOS itself
    if spec.train_on == "all":
        return list(enc.ids), [1] * len(enc.ids)
    starts = np.array([a for a, _ in enc.offsets])
    mask = np.zeros(len(enc.ids), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return list(enc.ids), mask.tolist()


def _prompt_completion_example(prompt, completion, row: int) -> tuple[list[int], list[int]]:
    s = _state
    spec = s["spec"]
    for name, value in ((spec.prompt_field, prompt), (spec.completion_field, completion)):
        if not isinstance(value, str):
            raise _record_error(row, f"field '{name}' must be a string (got {type(value).__name__}); "
                                     "set data.prompt_field / data.completion_field")
    if not completion.strip():
        raise _record_error(row, f"the completion ('{spec.completion_field}') is empty: nothing to learn from it")
    tok = s["tokenizer"]
    # The text whole, then the prompt alone (TRL's rule, so both give the same examples): the
    # answer starts where the two token sequences part. Tokenized apart, a word split across the
    # boundary would be split as no text the model ever reads is. EOS ends the answer.
    ids = tok.encode(prompt + completion, add_special_tokens=True).ids + [s["eos"]]
    prompt_ids = tok.encode(prompt, add_special_tokens=True).ids
    start = next((i for i, (a, b) in enumerate(zip(ids, prompt_ids)) if a != b), min(len(ids), len(prompt_ids)))
    trained = 1 if spec.train_on == "all" else 0
    return ids, [trained] * start + [1] * (len(ids) - start)


def tokenize_rows(start: int, stop: int, held_out: np.ndarray) -> ExampleChunk:
    s = _state
    spec, dtype = s["spec"], s["dtype"]
    if spec.format == "chat":
        columns = {"m": s["dataset"][start:stop][spec.messages_field]}
    else:
        batch = s["dataset"][start:stop]
        columns = {"p": batch[spec.prompt_field], "c": batch[spec.completion_field]}
    split = {"train": ([], [], []), "val": ([], [], [])}  # ids, masks, lengths
    counts = dict.fromkeys(COUNTERS, 0)
    for i, is_val in enumerate(held_out):
        row = start + i
        if spec.format == "chat":
            example = _chat_example(columns["m"][i], row)
            counts["text_chars"] += sum(len(m.get("content") or "") for m in columns["m"][i] or [] if isinstance(m, dict))
        else:
            example = _prompt_completion_example(columns["p"][i], columns["c"][i], row)
            counts["text_chars"] += len(columns["p"][i]) + len(columns["c"][i])
        if example is None:
            counts["no_answer"] += 1
            continue
        ids, mask = example
        mask[0] = 0  # an example's first token is predicted from nothing of its own: never a target
        if len(ids) > spec.seq_len:
            if spec.truncation == "drop":
                counts["dropped_long"] += 1
                continue
            ids, mask = ids[: spec.seq_len], mask[: spec.seq_len]
            counts["truncated"] += 1
        name = "val" if is_val else "train"
        ids_out, masks_out, lengths_out = split[name]
        ids_out.extend(ids)
        masks_out.extend(mask)
        lengths_out.append(len(ids))
        counts["val_examples" if is_val else "train_examples"] += 1
        counts["val_trained_tokens" if is_val else "trained_tokens"] += int(sum(mask))
    # Pages of a mapped file that were read stay in the RSS until unmapped: remap now and then, so a
    # worker's memory does not grow with the corpus (as tokenize_chunk does for text).
    s["chars_since_open"] += counts["text_chars"]
    if s["files"] is not None and s["chars_since_open"] > REMAP_EVERY_CHARS:
        s["dataset"] = None
        s["dataset"], s["chars_since_open"] = open_arrow(s["files"]), 0
    parts = {}
    for name, (ids_out, masks_out, lengths_out) in split.items():
        parts[f"{name}.bin"] = np.asarray(ids_out, dtype=dtype)
        parts[f"{name}.mask.bin"] = np.asarray(masks_out, dtype=np.uint8)
        parts[f"{name}.lengths.bin"] = np.asarray(lengths_out, dtype=np.uint32)
    return ExampleChunk(start, stop, parts, counts)
