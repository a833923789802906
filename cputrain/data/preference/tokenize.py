"""What one tokenizing process does for preference records: records [start, stop) → per pair two
sequences, prompt + chosen then prompt + rejected, each with a mask of its answer's tokens and its
length, stored adjacent (chosen first) in the examples' ids / mask / lengths streams.

A record is TRL's: plain strings (prompt, chosen, rejected), or conversations (lists of
messages) rendered with the chat template, the prompt being the shared messages. Without a
prompt field (the "implicit prompt" form) chosen and rejected are whole conversations (or texts)
and the prompt is their common beginning, as TRL's extract_prompt takes it; where the two first
part at a message that is not the assistant's, their prompts differ and the record is refused.

A string pair is tokenized as prompt/completion examples are (cputrain.data.sequences): the
whole text, then the prompt alone, the answer starting where the two token sequences part, then
EOS, trained. A conversational pair is the rendering of prompt + answer, the answer's assistant
turns trained (with the token that ends each). A pair whose answers are the same
teaches nothing (skipped_identical), one with an empty answer is skipped (skipped_empty), and one
longer than data.seq_len as it is laid out in a row is dropped (dropped_long): a pair is packed
whole into one row, never cut. Laid out is the two sequences whole, or with a shared prompt
(data.shared_prompt) prompt + chosen + one copied token + rejected answer, so a pair too long as
two sequences is kept where the shared layout fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cputrain.data import sequences
from cputrain.data.sequences import ChunkSequences, SequenceChunk, record_error
from cputrain.errors import DataError

COUNTERS = ("train_pairs", "val_pairs", "skipped_identical", "skipped_empty", "dropped_long", "trained_tokens",
            "val_trained_tokens", "text_chars", "non_text_parts", "tools_unsupported")


@dataclass(frozen=True)
class PreferenceSpec:
    """How records become pairs: everything that changes the tokens or the masks (the cache key hashes it)."""

    prompt_field: str
    chosen_field: str
    rejected_field: str
    template: str | None  # the chat template's text, for conversational records
    template_variables: dict
    seq_len: int
    # Pairs are measured in the shared-prompt layout (cputrain.data.preference.rows): a pair that fits
    # only shared is kept, so the cache's pairs depend on it.
    shared_prompt: bool = False
    margin_field: str | None = None  # each pair's margin (a number), kept in a stream of its own

    def key(self) -> dict:
        key = {"format": "preference", **self.__dict__}
        for name in ("shared_prompt", "margin_field"):  # caches tokenized before each key existed: still valid
            if not key[name]:
                del key[name]
        return key


def extract_prompt(chosen, rejected):
    """(prompt, chosen answer, rejected answer) of an implicit-prompt pair: their common beginning
    (messages, or characters of a text), as TRL's extract_prompt splits it."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if idx and chosen[idx - 1] == " ":  # a text: the space before the answer stays with it
                idx -= 1
            break
    else:
        idx = min(len(chosen), len(rejected))
    return chosen[:idx], chosen[idx:], rejected[idx:]


def pair_sequences(prompt, chosen, rejected, row: int) -> tuple[tuple[list[int], list[int]], ...] | str:
    """The pair's two sequences (ids, mask), chosen first; or the counter it is skipped under."""
    spec = sequences.state["spec"]
    names = (spec.chosen_field, spec.rejected_field)
    conversational = isinstance(chosen, list)
    for name, value in zip(names, (chosen, rejected)):
        if not isinstance(value, (str, list)) or isinstance(value, list) != conversational:
            raise record_error(row, f"fields '{names[0]}' and '{names[1]}' must both be strings or both lists of "
                                    f"messages (got {type(chosen).__name__} and {type(rejected).__name__})")
    if prompt is None:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
        if conversational and any(answer and not (isinstance(answer[0], dict) and answer[0].get("role") == "assistant")
                                  for answer in (chosen, rejected)):
            raise record_error(row, f"the conversations in '{names[0]}' and '{names[1]}' part before an assistant "
                                    "turn: their prompts differ. Give the shared prompt in data.prompt_field, or "
                                    "conversations that differ only in the answer")
    elif isinstance(prompt, list) != conversational or not isinstance(prompt, (str, list)):
        raise record_error(row, f"field '{spec.prompt_field}' must be a string with string answers, or a list of "
                                f"messages with conversational ones (got {type(prompt).__name__})")
    if chosen == rejected:
        return "skipped_identical"
    if sequences.answer_is_empty(chosen) or sequences.answer_is_empty(rejected):
        return "skipped_empty"
    if not conversational:
        return sequences.string_sequence(prompt, chosen), sequences.string_sequence(prompt, rejected)
    if spec.template is None:
        raise DataError("conversational preference pairs are rendered with a chat template, and the tokenizer has "
                        "none (nor the built-in template's tokens); set data.chat_template to a Jinja file")
    prompt_messages = sequences.messages(prompt, row, spec.prompt_field, spec.template) if prompt else []
    answer_turns_from = sum(m["role"] == "assistant" for m in prompt_messages)  # the answer's turns, not the prompt's
    return tuple(sequences.chat_sequence(prompt_messages + sequences.messages(answer, row, name, spec.template),
                                         answer_turns_from)
                 for name, answer in zip(names, (chosen, rejected)))


def shared_prefix(chosen: tuple[list[int], list[int]], rejected: tuple[list[int], list[int]]) -> int:
    """P of one pair, as cputrain.data.preference.rows.shared_prefixes finds it on the cache: the longest
    common prefix of the two sequences' ids, capped at the first trained token of either."""
    (c_ids, c_mask), (r_ids, r_mask) = chosen, rejected
    n = 0
    while n < min(len(c_ids), len(r_ids)) and c_ids[n] == r_ids[n] and not c_mask[n] and not r_mask[n]:
        n += 1
    return n


def row_tokens(pair: tuple[tuple[list[int], list[int]], ...], shared_prompt: bool) -> int:
    """Tokens the pair takes in a row: its two sequences whole, or with a shared prompt the
    rejected one without its prompt's 0…P-2 (cputrain.data.preference.rows lays it out so)."""
    whole = sum(len(ids) for ids, _ in pair)
    return whole - max(shared_prefix(*pair) - 1, 0) if shared_prompt else whole


def tokenize_rows(start: int, stop: int, held_out: np.ndarray) -> SequenceChunk:
    spec = sequences.state["spec"]
    prompts, chosens, rejecteds, margins = sequences.worker_columns(start, stop, spec.prompt_field, spec.chosen_field,
                                                                    spec.rejected_field, spec.margin_field)
    margins = margins if spec.margin_field else None
    kept_margins = {"train": [], "val": []}
    out = ChunkSequences()
    counts = dict.fromkeys(COUNTERS, 0)
    for i, is_val in enumerate(held_out):
        row = start + i
        prompt, chosen, rejected = prompts[i], chosens[i], rejecteds[i]
        if chosen is None or rejected is None:
            missing = spec.chosen_field if chosen is None else spec.rejected_field
            raise DataError(f"record {row + 1}: field '{missing}' is missing; every preference record needs "
                            f"'{spec.chosen_field}' and '{spec.rejected_field}' (data.chosen_field, data.rejected_field)")
        pair = sequences.record_sequences(pair_sequences, (prompt, chosen, rejected), row, counts)
        if pair is None:
            continue
        for _, mask in pair:
            mask[0] = 0  # a sequence's first token is predicted from nothing of its own: never a target
        if row_tokens(pair, spec.shared_prompt) > spec.seq_len:  # measured on the masks as stored
            counts["dropped_long"] += 1  # a pair is packed whole into one row, never cut
            continue
        for ids, mask in pair:
            counts["val_trained_tokens" if is_val else "trained_tokens"] += out.add(ids, mask, is_val)
        counts["val_pairs" if is_val else "train_pairs"] += 1
        if margins is not None:
            kept_margins["val" if is_val else "train"].append(_margin(margins[i], row, spec.margin_field))
    chunk = out.chunk(start, stop, counts)
    if margins is not None:
        for split, values in kept_margins.items():
            chunk.parts[f"{split}.margins.bin"] = np.asarray(values, dtype=np.float32)
    return chunk


def _margin(value, row: int, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise record_error(row, f"field '{name}' must be a number, how much better the chosen answer is than the "
                                f"rejected one (got {value!r}); fix it, or leave data.margin_field empty")
    return float(value)
