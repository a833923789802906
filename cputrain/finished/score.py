"""A reward model's score of each record of a file (`cputrain score`): one JSON line a record,
the record as it was with its reward added, for best-of-N, rejection sampling or filtering data.

A record is read as training reads one (the data kinds' own tokenizing, cputrain.data.feedback
and cputrain.data.sequences): a prompt and a completion (strings, or conversations with the chat
template; without a prompt, a conversational completion is the whole conversation and a string
one is scored alone) gets `reward`; a preference pair (chosen and rejected, with or without a
prompt) gets `reward_chosen` and `reward_rejected`; a chat record (messages) gets `reward` for its
closing assistant turns; a text record (text) for its text. A record with an empty answer gets
null, and so does one longer than the model's positions (a warning names its line). Each sequence
is scored as transformers' sequence classifier pools it, at its last token that is not padding,
which is the token the run trained its score at.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from cputrain.errors import DataError, ModelError, UserError

log = logging.getLogger("cputrain")


def _records(data: Path) -> Iterator[tuple[int, dict]]:
    if not data.is_file():
        raise DataError(f"--data '{data}' is not a file; give a .jsonl file of records")
    if data.suffix in (".parquet", ".arrow"):
        raise DataError(f"--data '{data}' is a {data.suffix[1:]} file; score reads .jsonl (one JSON object a line): "
                        "convert it, e.g. datasets.Dataset.from_parquet(path).to_json(out)")
    with open(data, "rb") as f:  # decoded line by line: a byte that is not UTF-8 is named by its line
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark some editors write
            except UnicodeDecodeError as err:
                raise DataError(f"{data.name} line {number} is not UTF-8 text (byte {err.object[err.start]:#04x} at "
                                f"column {err.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{data.name} line {number} is not JSON ({err.msg}); give one JSON object a line") \
                    from None
            if not isinstance(record, dict):
                raise DataError(f"{data.name} line {number} is not a JSON object; give one JSON object a line")
            yield number, record


def _answers(record: dict, fields, row: int) -> dict[str, tuple[list[int], list[int]] | None]:
    """The sequences to score, by the key their reward is written under (None: nothing to score)."""
    from cputrain.data.feedback.tokenize import feedback_sequence
    from cputrain.data.preference.tokenize import extract_prompt

    def one(prompt, answer):
        sequence = feedback_sequence(prompt, answer, row)
        return None if isinstance(sequence, str) else sequence

    prompt = record.get(fields.prompt_field)
    if fields.chosen_field in record and fields.rejected_field in record:
        chosen, rejected = record[fields.chosen_field], record[fields.rejected_field]
        if prompt is None and isinstance(chosen, type(rejected)):
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
            prompt = prompt or None
        return {"reward_chosen": one(prompt, chosen), "reward_rejected": one(prompt, rejected)}
    if fields.completion_field in record:
        return {"reward": one(prompt, record[fields.completion_field])}
    if fields.messages_field in record:
        return {"reward": one(None, record[fields.messages_field])}
    if isinstance(record.get("text"), str):
        return {"reward": one(None, record["text"])}
    raise DataError(f"record {row + 1} has no field to score: give '{fields.completion_field}' (with or without "
                    f"'{fields.prompt_field}'), '{fields.chosen_field}' and '{fields.rejected_field}', "
                    f"'{fields.messages_field}' or 'text'")


@torch.no_grad()
def _score(model, sequences: list[list[int]], pad_id: int, bf16: bool) -> list[float]:
    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, ids in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return model(input_ids=input_ids, attention_mask=attention).logits[:, 0].float().tolist()


def score_file(path: str, data: Path, out, data_cfg, bf16: bool = False, batch_size: int = 8,
               trust_remote_code: bool = False) -> int:
    """Write to `out` (a text stream) each record of `data` with its reward; returns the records
    scored. `data_cfg`: the run's data section (its field names and chat template)."""
    from cputrain.data import chat_template, sequences
    from cputrain.data.feedback.tokenize import FeedbackSpec
    from cputrain.finished.load import is_reward_model, load_for_inference, model_folder

    folder = model_folder(path)
    records = list(_records(data))  # every line read and checked before the model is loaded
    if not records:
        raise UserError(f"--data '{data}' holds no record")
    if not is_reward_model(folder):
        raise ModelError(f"the model in '{folder}' is not a reward model (a sequence classifier); train one with "
                         "train.objective=reward")
    model, tokenizer = load_for_inference(path, trust_remote_code)
    template = chat_template.template_for_records(tokenizer, data_cfg.chat_template)
    spec = FeedbackSpec(data_cfg.prompt_field, data_cfg.completion_field, data_cfg.label_field, template,
                        chat_template.template_variables(tokenizer), 0)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if model.config.pad_token_id is None:  # a classifier saved without one pools no batch of two (transformers)
        model.config.pad_token_id = pad_id
    sequences.init_worker(None, None, spec, tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id, "uint32")
    scored, pending = 0, []

    def flush():
        todo = [ids for _, answers in pending for seq in answers.values() if seq is not None for ids in [seq[0]]]
        rewards = iter(_score(model, todo, pad_id, bf16) if todo else [])
        for record, answers in pending:
            record.update({key: (next(rewards) if seq is not None else None) for key, seq in answers.items()})
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        pending.clear()

    positions = getattr(model.config, "max_position_embeddings", None)
    too_long: list[int] = []  # line numbers of records with a sequence past the model's positions
    for number, record in records:
        answers = _answers(record, data_cfg, number - 1)
        if positions and any(seq is not None and len(seq[0]) > positions for seq in answers.values()):
            # past the positions the model was trained on its score means nothing: null, as an empty answer's
            answers = {key: (None if seq is not None and len(seq[0]) > positions else seq)
                       for key, seq in answers.items()}
            too_long.append(number)
        pending.append((record, answers))
        scored += 1
        if len(pending) >= batch_size:
            flush()
    flush()
    if too_long:
        log.warning("score: %d record(s) of %s are longer than the model's %d positions and were scored null "
                    "(lines %s%s)", len(too_long), data.name, positions, ", ".join(map(str, too_long[:10])),
                    " …" if len(too_long) > 10 else "")
    return scored


def accuracy_of(rows: list[dict]) -> float:
    """The share of scored pairs whose chosen answer has the higher reward."""
    pairs = [(r["reward_chosen"], r["reward_rejected"]) for r in rows
             if r.get("reward_chosen") is not None and r.get("reward_rejected") is not None]
    return float(np.mean([c > r for c, r in pairs])) if pairs else float("nan")
