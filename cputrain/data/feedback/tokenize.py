"""What one tokenizing process does for unpaired feedback records: records [start, stop) → per
record one sequence, prompt + completion with a mask of the completion's tokens, its length and its
label (1 desirable, 0 undesirable), for the train and validation splits.

A record is TRL's unpaired preference: a prompt, a completion and a boolean label, plain strings or
conversations (lists of messages) rendered with the chat template. Without a prompt field a string
completion is trained whole, and a conversational one is the whole conversation, its closing
assistant turns the answer (the prompt being everything before them). The answer-token rule is the
examples' and the pairs' (cputrain.data.sequences): a string answer and EOS trained from where the
prompt's own tokens end, a conversation's answer turns each with the token that ends it.

A label that is not true or false stops the preparation naming the record; an empty answer is
skipped (skipped_empty), a conversation without a closing assistant turn too (no_answer). A record
longer than data.seq_len is dropped, or with data.truncation=truncate cut where its answer keeps a
trained token (else dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cputrain.data import sequences
from cputrain.data.sequences import ChunkSequences, SequenceChunk, record_error
from cputrain.errors import DataError

COUNTERS = ("train_examples", "val_examples", "desirable", "undesirable", "val_desirable", "val_undesirable",
            "skipped_empty", "no_answer", "dropped_long", "truncated", "trained_tokens", "val_trained_tokens",
            "text_chars", "non_text_parts", "tools_unsupported")


@dataclass(frozen=True)
class FeedbackSpec:
    """How records become labelled sequences: everything that changes the tokens, the masks or the
    labels (the cache key hashes it)."""

    prompt_field: str
    completion_field: str
    label_field: str
    template: str | None  # the chat template's text, for conversational records
    template_variables: dict
    seq_len: int
    truncation: str = "drop"

    def key(self) -> dict:
        # the name the format had when these caches were first written: a rename must not rebuild them
        return {"format": "unpaired", **self.__dict__}


# The strings a label may be spelled as. One rule whether all labels are strings or only some: the
# JSON reader turns "true" into true in a column it found boolean, so refusing the strings would
# hold only where every label is one.
LABEL_STRINGS = {"true": True, "false": False}


def _label(value, row: int, name: str) -> bool:
    # a boolean, or the word for one: 1 and "yes" are refused, not guessed (TRL's label is a boolean)
    if isinstance(value, str) and value.strip().lower() in LABEL_STRINGS:
        return LABEL_STRINGS[value.strip().lower()]
    if not isinstance(value, bool):
        raise record_error(row, f"field '{name}' must be true (a thumbs-up: desirable) or false (a thumbs-down: "
                                f"undesirable), not {value!r}; write each label as a JSON boolean, or set "
                                "data.label_field to the field that holds them")
    return value


def _conversation_answer(messages: list[dict]) -> int | None:
    """Where the closing assistant turns of a whole conversation start; None without one."""
    start = len(messages)
    while start and messages[start - 1]["role"] == "assistant":
        start -= 1
    return start if start < len(messages) else None


def feedback_sequence(prompt, completion, row: int) -> tuple[list[int], list[int]] | str:
    """The record's sequence (ids, mask), or the counter it is skipped under."""
    spec = sequences.state["spec"]
    conversational = isinstance(completion, list)
    if not isinstance(completion, (str, list)):
        raise record_error(row, f"field '{spec.completion_field}' must be a string or a list of messages "
                                f"(got {type(completion).__name__})")
    if prompt is not None and (isinstance(prompt, list) != conversational or not isinstance(prompt, (str, list))):
        raise record_error(row, f"field '{spec.prompt_field}' must be a string with a string completion, or a list "
                                f"of messages with a conversational one (got {type(prompt).__name__})")
    if sequences.answer_is_empty(completion):
        return "skipped_empty"
    if not conversational:
        return sequences.string_sequence(prompt or "", completion)
    if spec.template is None:
        raise DataError("conversational feedback is rendered with a chat template, and the tokenizer has none (nor "
                        "the built-in template's tokens); set data.chat_template to a Jinja file")
    answer = sequences.messages(completion, row, spec.completion_field, spec.template)
    if prompt is None:  # the whole conversation: its closing assistant turns are the answer
        start = _conversation_answer(answer)
        if start is None:
            return "no_answer"
        prompt_messages, answer = answer[:start], answer[start:]
    else:
        prompt_messages = sequences.messages(prompt, row, spec.prompt_field, spec.template) if prompt else []
    answer_turns_from = sum(m["role"] == "assistant" for m in prompt_messages)  # the answer's turns, not the prompt's
    return sequences.chat_sequence(prompt_messages + answer, answer_turns_from)


def tokenize_rows(start: int, stop: int, held_out: np.ndarray) -> SequenceChunk:
    spec = sequences.state["spec"]
    prompts, completions, labels = sequences.worker_columns(start, stop, spec.prompt_field, spec.completion_field,
                                                            spec.label_field)
    out = ChunkSequences()
    kept = {"train": [], "val": []}  # each kept sequence's label, in the order of its split's stream
    counts = dict.fromkeys(COUNTERS, 0)
    for i, is_val in enumerate(held_out):
        row = start + i
        prompt, completion = prompts[i], completions[i]
        for name, value in ((spec.completion_field, completion), (spec.label_field, labels[i])):
            if value is None:
                raise DataError(f"record {row + 1}: field '{name}' is missing; every unpaired feedback record needs "
                                f"'{spec.completion_field}' and '{spec.label_field}' (data.completion_field, "
                                "data.label_field)")
        label = _label(labels[i], row, spec.label_field)
        sequence = sequences.record_sequences(feedback_sequence, (prompt, completion), row, counts)
        if sequence is None:
            continue
        ids, mask = sequence
        mask[0] = 0  # a sequence's first token is predicted from nothing of its own: never a target
        if len(ids) > spec.seq_len:
            if spec.truncation == "drop" or not any(mask[: spec.seq_len]):
                counts["dropped_long"] += 1
                continue
            ids, mask = ids[: spec.seq_len], mask[: spec.seq_len]
            counts["truncated"] += 1
        split = "val" if is_val else "train"
        prefix = "val_" if is_val else ""
        counts[f"{prefix}trained_tokens"] += out.add(ids, mask, is_val)
        counts[f"{split}_examples"] += 1
        counts[f"{prefix}{'desirable' if label else 'undesirable'}"] += 1
        kept[split].append(label)
    chunk = out.chunk(start, stop, counts)
    for split, split_labels in kept.items():
        chunk.parts[f"{split}.labels.bin"] = np.asarray(split_labels, dtype=np.uint8)
    return chunk
