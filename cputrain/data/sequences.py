"""Sequences with a trained mask: what the kinds made of them share (examples: one sequence a
record; preference pairs: two).

A record of such a kind becomes token ids with a mask of the tokens that carry loss. A complete
cache entry (cputrain.data.prepare builds it) holds, for each split:

    train.bin          token ids of every sequence, back to back (uint16/uint32)
    train.mask.bin     1 where the token is a trained target, else 0 (uint8, one per token)
    train.lengths.bin  tokens per sequence (uint32), so sequences are found without a scan
    stats.json         written last: its presence marks the entry complete

Tokenizing (in the workers: imports stay light, a spawned worker needs no torch). A string
prompt and answer are the tokens of prompt + answer (with the tokenizer's BOS, if it adds one),
then EOS; the answer and EOS are trained, from where the prompt's own tokens end. A conversation
is rendered with the chat template and its assistant turns found as character spans of the
rendering (cputrain.data.chat_template); a token is trained when it starts inside one. Content
given as a list of parts (OpenAI's form) is its text parts joined; a conversation with a part
that is not text (an image) is skipped and counted. Tool calls (an assistant turn's
`tool_calls`, then `tool` turns with the results) are rendered by a template that writes them,
the calls trained as assistant turns and the results not; under a template that cannot write
them, the conversation is skipped and counted. The token that ends each trained answer is
trained: without it the model never learns to stop.

Rows (in the trainer). The ids and the mask are memory-mapped: a rank's RSS grows with the pages
it touches, not with the corpus. The lengths and their running sum are held (12 bytes per
sequence: 240 MB for 20M). Packing (data.packing) puts whole units (an example, a pair) into
rows of data.seq_len in corpus order, next-fit, so a row is one contiguous run of the ids; the
tail of a row is padding. Without packing a row is one unit, and a micro-batch is padded to its
longest row (right padding under a causal mask changes nothing before it).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cputrain.data.chat_template import (ROLES, answer_mask, assistant_spans, content_text, renders_tools,
                                         template_for_records, template_variables)
from cputrain.data.kind import BuildFacts, Worker
from cputrain.data.worker_corpus import WorkerCorpus
from cputrain.errors import DataError

if TYPE_CHECKING:  # annotations only: tokenizing workers import this module, and need no config
    from cputrain.config import DataConfig

log = logging.getLogger("cputrain")

# --- tokenizing: what a worker of any sequence kind does ----------------------------------------

# Set once per process by init_worker (the pool's initializer, or the builder when it works alone).
state: dict = {}


def field_chars(value) -> int:
    """Characters of a record's field for the cache's counts: a string's, or a conversation's
    message contents'."""
    if isinstance(value, list):
        return sum(len(content_text(m.get("content")) or "") for m in value if isinstance(m, dict))
    return len(value) if isinstance(value, str) else 0


def worker_columns(start: int, stop: int, *fields: str | None) -> list[list]:
    """Records start…stop of this worker's corpus, the named fields' columns (None for each record
    where the corpus has no such field or no field is named)."""
    batch = state["corpus"][start:stop]
    nothing = [None] * (stop - start)
    return [(batch.get(field) or nothing) if field else nothing for field in fields]


def answer_is_empty(answer) -> bool:
    """An answer with no text: an empty string, or no assistant turn with content or a tool call."""
    if isinstance(answer, str):
        return not answer.strip()
    return not any((content_text(m.get("content")) or "").strip() or m.get("tool_calls")
                   for m in answer if isinstance(m, dict) and m.get("role") == "assistant")


def init_worker(arrow_files: list[str] | None, dataset, spec, tokenizer_json: str, eos_id: int, dtype: str) -> None:
    """`spec`: the kind's (ExampleSpec, PreferenceSpec), which its tokenize_rows reads."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    from tokenizers import Tokenizer

    state.update(corpus=WorkerCorpus(arrow_files, dataset), spec=spec, tokenizer=Tokenizer.from_str(tokenizer_json),
                 eos=eos_id, dtype=np.dtype(dtype))


class Skipped(Exception):
    """A record left out and counted under this counter's name."""

    def __init__(self, counter: str):
        self.counter = counter


def record_error(row: int, what: str) -> DataError:
    return DataError(f"record {row + 1}: {what}")


def record_sequences(make, fields: tuple, row: int, counts: dict):
    """What `make(*fields, row)` makes of record `row` (a kind's sequences: feedback_sequence,
    pair_sequences), its fields' characters counted first (text_chars); None where the record is
    left out, counted under why: the counter `make` returns, or the Skipped its messages raise."""
    counts["text_chars"] += sum(map(field_chars, fields))
    try:
        made = make(*fields, row)
    except Skipped as skip:
        made = skip.counter
    if isinstance(made, str):
        counts[made] += 1
        return None
    return made


def _tool_calls(calls, row: int) -> list[dict]:
    """An assistant turn's tool calls as chat templates read them: {type, function: {name, arguments}},
    with arguments as a mapping (OpenAI's files give a JSON string; templates write it with tojson)."""
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise record_error(row, f"a tool call needs a function with a name (got {str(call)[:80]})")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # not JSON: kept as the text it is
        out.append({**{k: v for k, v in call.items() if v is not None}, "type": call.get("type") or "function",
                    "function": {"name": function["name"], "arguments": arguments if arguments is not None else {}}})
    return out


def messages(value, row: int, name: str, template: str) -> list[dict]:
    """Field `name` of record `row` as the messages the chat template renders; a record error where
    they are malformed, Skipped where they cannot be trained on (a part that is not text, tools the
    template cannot write)."""
    if not isinstance(value, list) or not value:
        raise record_error(row, f"field '{name}' must be a non-empty list of {{role, content}} messages; "
                                "set data.messages_field to the field that holds them")
    out = []
    for m in value:
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if not isinstance(m, dict) or "role" not in m or not (
                isinstance(m.get("content"), (str, list)) or (m.get("content") is None and calls)):
            raise record_error(row, f"every message needs a 'role' and a 'content', text or a list of text parts "
                                    f"(an assistant turn with tool_calls may have none) (got {str(m)[:80]})")
        if m["role"] not in ROLES:
            raise record_error(row, f"unknown role '{m['role']}'; the roles are {', '.join(ROLES)}")
        content = content_text(m.get("content"))
        if content is None:
            raise Skipped("non_text_parts")
        if (calls or m["role"] == "tool") and not renders_tools(template):
            raise Skipped("tools_unsupported")
        if m["role"] == "assistant" and not content.strip() and not calls:
            raise record_error(row, "an assistant turn is empty: nothing to learn from it; fill or remove it")
        message = {"role": m["role"], "content": content}
        if calls:
            message["tool_calls"] = _tool_calls(calls, row)
        for key in ("name", "tool_call_id"):  # a tool turn's, which templates may write
            if m["role"] == "tool" and isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def chat_sequence(conversation: list[dict], trained_turns_from: int = 0,
                  train_all: bool = False) -> tuple[list[int], list[int]]:
    """A conversation rendered with the spec's template, as ids and a mask: its assistant turns from
    the `trained_turns_from`-th on trained (each with the token that ends it), or every token."""
    spec = state["spec"]
    text, spans = assistant_spans(spec.template, conversation, spec.template_variables)
    enc = state["tokenizer"].encode(text, add_special_tokens=False)  # the template writes any BOS itself
    if train_all:
        return list(enc.ids), [1] * len(enc.ids)
    return list(enc.ids), answer_mask(enc.offsets, spans[trained_turns_from:]).tolist()


def string_sequence(prompt: str, answer: str, train_prompt: bool = False) -> tuple[list[int], list[int]]:
    """prompt + answer as ids and a mask: the answer and EOS trained (the prompt too with `train_prompt`)."""
    tok = state["tokenizer"]
    # The text whole, then the prompt alone (TRL's rule, so both give the same sequences): the
    # answer starts where the two token sequences part. Tokenized apart, a word split across the
    # boundary would be split as no text the model ever reads is. EOS ends the answer.
    ids = tok.encode(prompt + answer, add_special_tokens=True).ids + [state["eos"]]
    prompt_ids = tok.encode(prompt, add_special_tokens=True).ids
    start = next((i for i, (a, b) in enumerate(zip(ids, prompt_ids)) if a != b), min(len(ids), len(prompt_ids)))
    return ids, [int(train_prompt)] * start + [1] * (len(ids) - start)


@dataclass
class SequenceChunk:
    start: int
    stop: int
    parts: dict  # stream file name → array: train.bin / .mask.bin / .lengths.bin, and val.*
    counts: dict


class ChunkSequences:
    """The sequences a worker keeps of its chunk of records, per split, until they are its arrays."""

    def __init__(self):
        self.split = {"train": ([], [], []), "val": ([], [], [])}  # ids, masks, lengths

    def add(self, ids: list[int], mask: list[int], is_val: bool) -> int:
        """One sequence appended to its split; the tokens it trains."""
        ids_out, masks_out, lengths_out = self.split["val" if is_val else "train"]
        ids_out.extend(ids)
        masks_out.extend(mask)
        lengths_out.append(len(ids))
        return int(sum(mask))

    def chunk(self, start: int, stop: int, counts: dict) -> SequenceChunk:
        """The chunk of records [start, stop) as the streams' arrays, with its counters."""
        state["corpus"].read(counts["text_chars"])
        parts = {}
        for name, (ids_out, masks_out, lengths_out) in self.split.items():
            parts[f"{name}.bin"] = np.asarray(ids_out, dtype=state["dtype"])
            parts[f"{name}.mask.bin"] = np.asarray(masks_out, dtype=np.uint8)
            parts[f"{name}.lengths.bin"] = np.asarray(lengths_out, dtype=np.uint32)
        return SequenceChunk(start, stop, parts, counts)


# --- the kind: what a sequence kind is to the cache builder -------------------------------------


class SequenceKind:
    """The DataKind methods every sequence kind has alike: its streams, its worker (init_worker,
    then the kind's tokenize_rows) and counters, its spec as its part of the cache key, and the
    token figures its stats.json ends with. A kind sets `spec`, `tokenizer` and `worker_module`."""

    spec: Any  # how records become sequences (its key() is the kind's part of the cache key)
    tokenizer: Any
    worker_module: Any  # the kind's tokenize module: its tokenize_rows is what every worker runs

    @property
    def counters(self) -> tuple[str, ...]:
        """What a worker counts of its chunk: its tokenize module's COUNTERS."""
        return self.worker_module.COUNTERS

    def streams(self, token_dtype: str) -> dict[str, str]:
        return {f"{split}{suffix}": dtype for split in ("train", "val")
                for suffix, dtype in ((".bin", token_dtype), (".mask.bin", "uint8"), (".lengths.bin", "uint32"))}

    def worker(self, corpus, token_dtype: str) -> Worker:
        tok = self.tokenizer
        return Worker(init_worker, (self.spec, tok.backend_tokenizer.to_str(), tok.eos_token_id, token_dtype),
                      self.worker_module.tokenize_rows)

    def key(self) -> dict:
        return self.spec.key()

    def token_stats(self, progress) -> dict:
        """The tokens of the entry, those trained, and the id that pads rows."""
        tok = self.tokenizer
        train_tokens, val_tokens = progress.items["train.bin"], progress.items["val.bin"]
        return {
            "train_tokens": train_tokens,
            "val_tokens": val_tokens,
            "trained_tokens": progress["trained_tokens"],
            "val_trained_tokens": progress["val_trained_tokens"],
            "trained_token_share": round(progress["trained_tokens"] / max(1, train_tokens), 4),
            "pad_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        }


# What `messages` leaves out of a conversation, and why, as the records kinds' warnings say it.
MESSAGE_SKIPS = (("non_text_parts", "had content parts that are not text"),
                 ("tools_unsupported", "had tool calls the chat template cannot write"))


class RecordsKind(SequenceKind):
    """A kind of TRL's records beside the examples (preference pairs, unpaired feedback): a prompt
    that may be missing and its answers, strings or conversations, the conversations rendered with
    the template for records, which the tokenizer then carries (chat_template.template_for_records).
    A kind makes its spec from the data section and that template (spec_of)."""

    def __init__(self, data_cfg: DataConfig, tokenizer):
        template = template_for_records(tokenizer, data_cfg.chat_template)
        self.spec = self.spec_of(data_cfg, template, template_variables(tokenizer))
        self.tokenizer = tokenizer

    def spec_of(self, data_cfg: DataConfig, template: str | None, variables: dict):
        """The kind's spec: `data_cfg`'s fields, the template and the `variables` it is rendered with."""
        raise NotImplementedError

    @staticmethod
    def warn_left_out(facts: BuildFacts, units: str, whys: tuple[tuple[str, str], ...]) -> None:
        """A warning for each counter of `units` ("pair(s)") left out, with `whys` its reason: the
        kind's own, then what `messages` left out."""
        progress = facts.progress
        for counter, why in (*whys, *MESSAGE_SKIPS):
            if progress[counter]:
                log.warning("data: %d %s of %s %s and were left out (stats.json: %s)", progress[counter], units,
                            facts.data_cfg.source, why, counter)


# --- rows: what the trainer's rows of any sequence kind stand on ---------------------------------


def pack_bounds(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Row boundaries in unit indices (next-fit in order; a unit is an example, a pair): row r holds
    units [b[r], b[r+1]), `lengths` being the units' tokens."""
    bounds, fill = [0], 0
    for i, n in enumerate(lengths.tolist()):
        if fill + n > seq_len and fill:
            bounds.append(i)
            fill = 0
        fill += n
    if len(lengths):
        bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


class SequenceRows:
    """The streams of one split, where each sequence starts, and its rows: a kind's rows class sets
    `bounds` (row r holds its units [bounds[r], bounds[r+1])), says its `tokens` (padding aside)
    and cuts its micro-batches."""

    bounds: np.ndarray

    def __init__(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, seq_len: int, packing: bool,
                 pad_id: int):
        self.ids, self.mask, self.lengths = ids, mask, lengths.astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        self.seq_len, self.packing, self.pad_id = seq_len, packing, pad_id

    def __len__(self) -> int:
        return max(0, len(self.bounds) - 1)

    def width(self, rows: list) -> int:
        """Tokens per row of the micro-batch of `rows` as cut (each a tuple starting with its ids):
        data.seq_len when packed, else the longest row's."""
        return self.seq_len if self.packing else max(len(ids) for ids, *_ in rows)

    def prompt_of(self, sequence: int) -> list[int]:
        """A sequence's tokens before its first trained one: the prompt a model is asked to answer
        (for a chat, through the assistant's header)."""
        t0, t1 = self.offsets[sequence], self.offsets[sequence + 1]
        trained = np.flatnonzero(np.asarray(self.mask[t0:t1]))
        end = t0 + (int(trained[0]) if len(trained) else t1 - t0)
        return np.asarray(self.ids[t0:end], dtype=np.int64).tolist()


@dataclass
class SequenceData:
    """A complete entry opened: its rows of each split and its stats (with packing's figures)."""

    train: Any  # the kind's SequenceRows
    val: Any
    stats: dict
    folder: Path | None = None

    def rows(self, split: str):
        """The rows of `split` ("train" or "val") the trainer and evaluation take batches from."""
        return getattr(self, split)

    def described(self, units: str, one: str, left_out: str) -> str:
        """describe()'s line, alike for every sequence kind: the entry's `units`, its train tokens and
        the share of them trained, how the units are laid out in rows (`one` names a unit without
        packing: "one", "one pair"), then what was `left_out`."""
        s = self.stats
        packed = (f"packed into {s['train_sequences']} train rows of {s['seq_len']} tokens "
                  f"({s['packing_efficiency']:.1%} filled)" if s["packing"] else
                  f"{one} per row, each micro-batch padded to its longest (data.packing=false)")
        return (f"{units}, {s['train_tokens']} train tokens of which {s['trained_token_share']:.1%} trained; "
                f"{packed}; {left_out}")


def _stream(path: Path, dtype, n: int) -> np.ndarray:
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.empty(0, dtype=dtype)


def open_rows(folder: Path, packing: bool, rows_class, sequences_of) -> tuple:
    """(train rows, val rows, stats) of a complete entry: `rows_class` (a SequenceRows) over each
    split's memory-mapped ids and mask and its lengths, `sequences_of(stats, split)` sequences
    long; the stats with packing's figures added."""
    stats = json.loads((folder / "stats.json").read_text())
    seq_len, pad_id = stats["seq_len"], stats["pad_id"]

    def rows_of(split: str):
        tokens, sequences = stats[f"{split}_tokens"], sequences_of(stats, split)
        lengths = np.fromfile(folder / f"{split}.lengths.bin", dtype=np.uint32, count=sequences) if sequences else \
            np.empty(0, dtype=np.uint32)
        return rows_class(_stream(folder / f"{split}.bin", stats["token_dtype"], tokens),
                          _stream(folder / f"{split}.mask.bin", np.uint8, tokens), lengths, seq_len, packing, pad_id)

    train, val = rows_of("train"), rows_of("val")
    rows = len(train) * seq_len
    stats = {**stats, "packing": packing, "train_sequences": len(train), "val_sequences": len(val),
             # tokens that are sequences, of all the row positions packing fills (the rest is padding)
             "packing_efficiency": round(train.tokens / rows, 4) if packing and rows else None}
    return train, val, stats
