"""Preference pairs: a prompt with a chosen and a rejected answer, as TRL's preference datasets
hold them. Tokenized by tokenize_preferences into the examples' streams (chosen then rejected,
adjacent); opened as pairs.PreferenceData, whole pairs packed into rows."""

from __future__ import annotations

import logging
from pathlib import Path

from cputrain.config import DataConfig
from cputrain.data import tokenize_preferences
from cputrain.data.example_kind import sequence_streams
from cputrain.data.kind import BuildFacts, Worker
from cputrain.data.pairs import PreferenceData, open_pairs
from cputrain.data.tokenize_preferences import PreferenceSpec
from cputrain.errors import DataError

log = logging.getLogger("cputrain")


def shared_prompt(data_cfg: DataConfig) -> bool:
    """The layout of the pairs in rows; "auto" only where the config was not decided (training.choices
    decides it first): preference's auto is true."""
    return data_cfg.shared_prompt in (True, "auto")


class PreferenceKind:
    what = "preference pairs"
    counters = tokenize_preferences.COUNTERS

    def __init__(self, data_cfg: DataConfig, tokenizer):
        from cputrain.data import chat_template

        # Conversational pairs are rendered with the chat template; the tokenizer takes it, so the
        # exported model/ carries it (as for chat examples). String pairs never read it.
        try:
            template = chat_template.template_of(tokenizer, data_cfg.chat_template)
            tokenizer.chat_template = template
        except DataError:
            template = None  # string pairs need none; a conversational pair then says so (the worker)
        self.spec = PreferenceSpec(data_cfg.prompt_field, data_cfg.chosen_field, data_cfg.rejected_field, template,
                                   chat_template.template_variables(tokenizer), data_cfg.seq_len,
                                   shared_prompt(data_cfg))
        self.tokenizer = tokenizer

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields every record must have: the prompt may be missing (the implicit-prompt form)."""
        return self.spec.chosen_field, self.spec.rejected_field

    def streams(self, token_dtype: str) -> dict[str, str]:
        return sequence_streams(token_dtype)

    def worker(self, corpus, token_dtype: str) -> Worker:
        tok = self.tokenizer
        return Worker(tokenize_preferences.init_worker, (self.spec, tok.backend_tokenizer.to_str(), tok.eos_token_id,
                                                         token_dtype), tokenize_preferences.tokenize_rows)

    def key(self) -> dict:
        return self.spec.key()

    def open(self, folder: Path, data_cfg: DataConfig) -> PreferenceData:
        # "auto" only where the config was not decided (training.choices decides it first): preference's auto
        return open_pairs(folder, data_cfg.packing, shared_prompt(data_cfg))

    def stats(self, facts: BuildFacts) -> dict:
        data_cfg, progress, tok = facts.data_cfg, facts.progress, self.tokenizer
        train_tokens, val_tokens = progress.items["train.bin"], progress.items["val.bin"]
        for counter, what in (("skipped_identical", "had the same chosen and rejected answer"),
                              ("skipped_empty", "had an empty answer"),
                              ("dropped_long", f"were longer than data.seq_len={data_cfg.seq_len} as laid out in a "
                                               "row (a pair is packed whole into one row)"),
                              ("non_text_parts", "had content parts that are not text"),
                              ("tools_unsupported", "had tool calls the chat template cannot write")):
            if progress[counter]:
                log.warning("data: %d pair(s) of %s %s and were left out (stats.json: %s)", progress[counter],
                            data_cfg.source, what, counter)
        if progress["train_pairs"] == 0:
            raise DataError(
                f"no training pair in '{data_cfg.source}': {progress['skipped_identical']} had identical answers, "
                f"{progress['skipped_empty']} an empty one and {progress['dropped_long']} were longer than "
                f"data.seq_len={data_cfg.seq_len} as laid out in a row; check the data's fields, or raise "
                "data.seq_len")
        return {
            **facts.common_stats(),
            "format": "preference",
            "train_on": "completion",
            "train_pairs": progress["train_pairs"],
            "val_pairs": progress["val_pairs"],
            # two sequences per pair, chosen then rejected, in the examples' streams
            "train_examples": 2 * progress["train_pairs"],
            "val_examples": 2 * progress["val_pairs"],
            "skipped_identical": progress["skipped_identical"],
            "skipped_empty": progress["skipped_empty"],
            "skipped_non_text_parts": progress["non_text_parts"],
            "skipped_tools_unsupported": progress["tools_unsupported"],
            "dropped_long": progress["dropped_long"],
            "train_tokens": train_tokens,
            "val_tokens": val_tokens,
            "trained_tokens": progress["trained_tokens"],
            "val_trained_tokens": progress["val_trained_tokens"],
            "trained_token_share": round(progress["trained_tokens"] / max(1, train_tokens), 4),
            "pad_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        }
