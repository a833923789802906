"""Preference pairs: a prompt with a chosen and a rejected answer, as TRL's preference datasets
hold them. A sequence kind (cputrain.data.sequences): tokenized by preference.tokenize into two
sequences a pair (chosen then rejected, adjacent); opened as preference.rows.PreferenceData,
whole pairs packed into rows."""

from __future__ import annotations

from pathlib import Path

from cputrain.config import DataConfig
from cputrain.data.kind import BuildFacts
from cputrain.data.preference import tokenize
from cputrain.data.preference.rows import PreferenceData, open_pairs
from cputrain.data.preference.tokenize import PreferenceSpec
from cputrain.data.sequences import RecordsKind
from cputrain.errors import DataError


def shared_prompt(data_cfg: DataConfig) -> bool:
    """The layout of the pairs in rows; "auto" only where the config was not decided (training.choices
    decides it first): preference's auto is true."""
    return data_cfg.shared_prompt in (True, "auto")


class PreferenceKind(RecordsKind):
    what = "preference pairs"
    worker_module = tokenize

    def spec_of(self, data_cfg: DataConfig, template: str | None, variables: dict) -> PreferenceSpec:
        return PreferenceSpec(data_cfg.prompt_field, data_cfg.chosen_field, data_cfg.rejected_field, template,
                              variables, data_cfg.seq_len, shared_prompt(data_cfg), data_cfg.margin_field)

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields every record must have: the prompt may be missing (the implicit-prompt form)."""
        margin = (self.spec.margin_field,) if self.spec.margin_field else ()
        return self.spec.chosen_field, self.spec.rejected_field, *margin

    def streams(self, token_dtype: str) -> dict[str, str]:
        margins = {"train.margins.bin": "float32", "val.margins.bin": "float32"} if self.spec.margin_field else {}
        return {**super().streams(token_dtype), **margins}

    def open(self, folder: Path, data_cfg: DataConfig) -> PreferenceData:
        # "auto" only where the config was not decided (training.choices decides it first): preference's auto
        return open_pairs(folder, data_cfg.packing, shared_prompt(data_cfg))

    def stats(self, facts: BuildFacts) -> dict:
        data_cfg, progress = facts.data_cfg, facts.progress
        self.warn_left_out(facts, "pair(s)", (
            ("skipped_identical", "had the same chosen and rejected answer"),
            ("skipped_empty", "had an empty answer"),
            ("dropped_long", f"were longer than data.seq_len={data_cfg.seq_len} as laid out in a row (a pair is "
                             "packed whole into one row)")))
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
            # two sequences per pair, chosen then rejected, in the sequence kinds' streams
            "train_examples": 2 * progress["train_pairs"],
            "val_examples": 2 * progress["val_pairs"],
            "skipped_identical": progress["skipped_identical"],
            "skipped_empty": progress["skipped_empty"],
            "skipped_non_text_parts": progress["non_text_parts"],
            "skipped_tools_unsupported": progress["tools_unsupported"],
            "dropped_long": progress["dropped_long"],
            "margin_field": self.spec.margin_field,
            **self.token_stats(progress),
        }
