"""What one tokenizing process does for chat, prompt/completion and Alpaca records: records
[start, stop) → token ids, a trained-token mask and example lengths, for the train and validation splits.

A chat record is one conversation, its assistant turns trained; a prompt/completion record is
prompt + completion, then EOS, the completion and EOS trained (cputrain.data.sequences: how
either is tokenized and which tokens are trained). An Alpaca record (instruction, optional input,
output) is a prompt/completion record whose prompt is Stanford Alpaca's. With data.train_on=all
every token is trained. An example longer than data.seq_len is dropped, or cut with
data.truncation=truncate. The worker starts as every sequence kind's (sequences.init_worker).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cputrain.data import sequences
from cputrain.data.chat_template import content_text
from cputrain.data.sequences import ChunkSequences, SequenceChunk, Skipped, record_error


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


def _chat_example(value, row: int) -> tuple[list[int], list[int]] | None:
    spec = sequences.state["spec"]
    messages = sequences.messages(value, row, spec.messages_field, spec.template)
    if not any(m["role"] == "assistant" for m in messages):
        return None  # nothing to train on: skipped and counted
    return sequences.chat_sequence(messages, train_all=spec.train_on == "all")


def _prompt_completion_example(prompt, completion, row: int) -> tuple[list[int], list[int]]:
    spec = sequences.state["spec"]
    names = ALPACA_FIELDS if spec.format == "alpaca" else (spec.prompt_field, spec.completion_field)
    for name, value in zip(names, (prompt, completion)):
        if not isinstance(value, str):
            raise record_error(row, f"field '{name}' must be a string (got {type(value).__name__}); "
                                    "set data.prompt_field / data.completion_field")
    if not completion.strip():
        raise record_error(row, f"the completion ('{names[1]}') is empty: nothing to learn from it")
    return sequences.string_sequence(prompt, completion, train_prompt=spec.train_on == "all")


def alpaca_prompt(instruction, input_text, row: int) -> str:
    if not isinstance(instruction, str) or not (input_text is None or isinstance(input_text, str)):
        raise record_error(row, "an Alpaca record needs a string 'instruction' and, if any, a string 'input'")
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


def tokenize_rows(start: int, stop: int, held_out: np.ndarray) -> SequenceChunk:
    s = sequences.state
    spec = s["spec"]
    columns = _columns(spec, s["corpus"][start:stop], stop - start)
    out = ChunkSequences()
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
        except Skipped as skip:
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
        counts["val_examples" if is_val else "train_examples"] += 1
        counts["val_trained_tokens" if is_val else "trained_tokens"] += out.add(ids, mask, is_val)
    return out.chunk(start, stop, counts)

