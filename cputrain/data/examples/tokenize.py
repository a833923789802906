"""What one tokenizing process does for chat, prompt/completion and Alpaca records: records
[start, stop) → token ids, a trained-token mask and example lengths, for the train and validation splits.

A chat record is rendered with the chat template and its assistant turns found as character
spans of the rendering (cputrain.data.chat_template); a token is trained when it starts inside
one. Content given as a list of parts (OpenAI's form) is its text parts joined; a conversation
with a part that is not text (an image) is skipped and counted. Tool calls (an assistant turn's
`tool_calls`, then `tool` turns with the results) are rendered by a template that writes them,
the calls trained as assistant turns and the results not; under a template that cannot write
them, the conversation is skipped and counted. An Alpaca record (instruction, optional input,
output) is a prompt/completion record whose prompt is Stanford Alpaca's. A prompt/completion
record is the tokens of prompt + completion (with the tokenizer's BOS, if it adds one), then EOS;
the completion and EOS are trained, from where the prompt's own tokens end. The token that ends
each trained answer is trained: without it the model never learns to stop.
Like tokenize_chunk, a worker opens the Arrow files itself and needs no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from cputrain.data.chat_template import (
    ROLES,
    answer_mask,
    assistant_spans,
    content_text,
    renders_tools,
)
from cputrain.data.worker_corpus import WorkerCorpus
from cputrain.errors import DataError

_state: dict = {}  # set once per process by init_worker


@dataclass(frozen=True)
class ExampleSpec:
    """How records become examples: everything that changes the tokens or the mask (the cache key
    hashes it)."""

    format: str  # chat | prompt_completion | alpaca
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
            "val_trained_tokens", "text_chars", "non_text_parts", "tools_unsupported")

# Stanford Alpaca's prompts (github.com/tatsu-lab/stanford_alpaca, train.py), as torchtune's and
# axolotl's alpaca formats write them: the model learns the answer after "### Response:".
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
ALPACA_FIELDS = ("instruction", "output")  # and "input", which may be missing or empty


class _Skipped(Exception):
    """A record left out and counted under this counter's name."""

    def __init__(self, counter: str):
        self.counter = counter


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

    _state.update(corpus=WorkerCorpus(arrow_files, dataset), spec=spec, tokenizer=Tokenizer.from_str(tokenizer_json),
                  eos=eos_id, dtype=np.dtype(dtype))


def _record_error(row: int, what: str) -> DataError:
    return DataError(f"record {row + 1}: {what}")


def _tool_calls(calls, row: int) -> list[dict]:
    """An assistant turn's tool calls as chat templates read them: {type, function: {name, arguments}},
    with arguments as a mapping (OpenAI's files give a JSON string; templates write it with tojson)."""
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _record_error(row, f"a tool call needs a function with a name (got {str(call)[:80]})")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # not JSON: kept as the text it is
        out.append({**{k: v for k, v in call.items() if v is not None}, "type": call.get("type") or "function",
                    "function": {"name": function["name"], "arguments": arguments if arguments is not None else {}}})
    return out


def _messages(value, row: int, name: str, template: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _record_error(row, f"field '{name}' must be a non-empty list of {{role, content}} messages; "
                                 "set data.messages_field to the field that holds them")
    out = []
    for m in value:
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if not isinstance(m, dict) or "role" not in m or not (
                isinstance(m.get("content"), (str, list)) or (m.get("content") is None and calls)):
            raise _record_error(row, f"every message needs a 'role' and a 'content', text or a list of text parts "
                                     f"(an assistant turn with tool_calls may have none) (got {str(m)[:80]})")
        if m["role"] not in ROLES:
            raise _record_error(row, f"unknown role '{m['role']}'; the roles are {', '.join(ROLES)}")
        content = content_text(m.get("content"))
        if content is None:
            raise _Skipped("non_text_parts")
        if (calls or m["role"] == "tool") and not renders_tools(template):
            raise _Skipped("tools_unsupported")
        if m["role"] == "assistant" and not content.strip() and not calls:
            raise _record_error(row, "an assistant turn is empty: nothing to learn from it; fill or remove it")
        message = {"role": m["role"], "content": content}
        if calls:
            message["tool_calls"] = _tool_calls(calls, row)
        for key in ("name", "tool_call_id"):  # a tool turn's, which templates may write
            if m["role"] == "tool" and isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def _chat_example(value, row: int) -> tuple[list[int], list[int]] | None:
    s = _state
    spec = s["spec"]
    messages = _messages(value, row, spec.messages_field, spec.template)
    if not any(m["role"] == "assistant" for m in messages):
        return None  # nothing to train on: skipped and counted
    text, spans = assistant_spans(spec.template, messages, spec.template_variables)
    enc = s["tokenizer"].encode(text, add_special_tokens=False)  # the template writes any BOS itself
    if spec.train_on == "all":
        return list(enc.ids), [1] * len(enc.ids)
    return list(enc.ids), answer_mask(enc.offsets, spans).tolist()


def _prompt_completion_example(prompt, completion, row: int) -> tuple[list[int], list[int]]:
    s = _state
    spec = s["spec"]
    names = ALPACA_FIELDS if spec.format == "alpaca" else (spec.prompt_field, spec.completion_field)
    for name, value in zip(names, (prompt, completion)):
        if not isinstance(value, str):
            raise _record_error(row, f"field '{name}' must be a string (got {type(value).__name__}); "
                                     "set data.prompt_field / data.completion_field")
    if not completion.strip():
        raise _record_error(row, f"the completion ('{names[1]}') is empty: nothing to learn from it")
    tok = s["tokenizer"]
    # The text whole, then the prompt alone (TRL's rule, so both give the same examples): the
    # answer starts where the two token sequences part. Tokenized apart, a word split across the
    # boundary would be split as no text the model ever reads is. EOS ends the answer.
    ids = tok.encode(prompt + completion, add_special_tokens=True).ids + [s["eos"]]
    prompt_ids = tok.encode(prompt, add_special_tokens=True).ids
    start = next((i for i, (a, b) in enumerate(zip(ids, prompt_ids)) if a != b), min(len(ids), len(prompt_ids)))
    trained = 1 if spec.train_on == "all" else 0
    return ids, [trained] * start + [1] * (len(ids) - start)


def alpaca_prompt(instruction, input_text, row: int) -> str:
    if not isinstance(instruction, str) or not (input_text is None or isinstance(input_text, str)):
        raise _record_error(row, "an Alpaca record needs a string 'instruction' and, if any, a string 'input'")
    if input_text and input_text.strip():
        return ALPACA_PROMPT.format(instruction=instruction, input=input_text)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def _columns(spec: ExampleSpec, batch: dict, rows: int) -> dict:
    """The batch's columns as prompt and completion ("p", "c"), or messages ("m")."""
    if spec.format == "chat":
        return {"m": batch[spec.messages_field]}
    if spec.format == "alpaca":
        inputs = batch.get("input") or [None] * rows
        return {"p": [(instruction, text) for instruction, text in zip(batch["instruction"], inputs)],
                "c": batch["output"]}
    return {"p": batch[spec.prompt_field], "c": batch[spec.completion_field]}


def _chars(spec: ExampleSpec, columns: dict, i: int) -> int:
    if spec.format == "chat":
        return sum(len(content_text(m.get("content")) or "") for m in columns["m"][i] or [] if isinstance(m, dict))
    prompt = columns["p"][i]
    prompt_chars = sum(len(x or "") for x in prompt) if isinstance(prompt, tuple) else len(prompt or "")
    return prompt_chars + len(columns["c"][i] or "")


def tokenize_rows(start: int, stop: int, held_out: np.ndarray) -> ExampleChunk:
    s = _state
    spec, dtype = s["spec"], s["dtype"]
    columns = _columns(spec, s["corpus"][start:stop], stop - start)
    split = {"train": ([], [], []), "val": ([], [], [])}  # ids, masks, lengths
    counts = dict.fromkeys(COUNTERS, 0)
    for i, is_val in enumerate(held_out):
        row = start + i
        counts["text_chars"] += _chars(spec, columns, i)
        try:
            if spec.format == "chat":
                example = _chat_example(columns["m"][i], row)
            else:
                prompt = alpaca_prompt(*columns["p"][i], row) if spec.format == "alpaca" else columns["p"][i]
                example = _prompt_completion_example(prompt, columns["c"][i], row)
        except _Skipped as skip:
            counts[skip.counter] += 1
            continue
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
    return finish_chunk(s, start, stop, split, counts, dtype)


def finish_chunk(s: dict, start: int, stop: int, split: dict, counts, dtype) -> ExampleChunk:
    """A worker's chunk of sequences as the streams' arrays (`split`: name → ids, masks, lengths)."""
    s["corpus"].read(counts["text_chars"])
    parts = {}
    for name, (ids_out, masks_out, lengths_out) in split.items():
        parts[f"{name}.bin"] = np.asarray(ids_out, dtype=dtype)
        parts[f"{name}.mask.bin"] = np.asarray(masks_out, dtype=np.uint8)
        parts[f"{name}.lengths.bin"] = np.asarray(lengths_out, dtype=np.uint32)
    return ExampleChunk(start, stop, parts, counts)
