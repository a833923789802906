"""Prompt-only records (TRL's, for GRPOTrainer and RLOOTrainer): a prompt, plain or conversational,
and any other columns the reward functions read. A sequence kind (cputrain.data.sequences) whose
sequences are the prompts, nothing trained, with two more streams: each record's columns as JSON
and their lengths; tokenized by prompts.tokenize, opened as prompts.rows.PromptData."""

from __future__ import annotations

from pathlib import Path

from cputrain.config import DataConfig
from cputrain.data.kind import BuildFacts
from cputrain.data.prompts import tokenize
from cputrain.data.prompts.rows import PromptData, open_prompts
from cputrain.data.prompts.tokenize import PromptSpec
from cputrain.data.sequences import RecordsKind
from cputrain.errors import DataError


class PromptKind(RecordsKind):
    what = "prompts"
    worker_module = tokenize

    def spec_of(self, data_cfg: DataConfig, template: str | None, variables: dict) -> PromptSpec:
        return PromptSpec(data_cfg.prompt_field, template, variables, data_cfg.seq_len)

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.spec.prompt_field,)

    def streams(self, token_dtype: str) -> dict[str, str]:
        return {**super().streams(token_dtype), "train.columns.bin": "uint8", "val.columns.bin": "uint8",
                "train.columns_lengths.bin": "uint32", "val.columns_lengths.bin": "uint32"}

    def open(self, folder: Path, data_cfg: DataConfig) -> PromptData:
        return open_prompts(folder)

    def stats(self, facts: BuildFacts) -> dict:
        data_cfg, progress = facts.data_cfg, facts.progress
        self.warn_left_out(facts, "prompt(s)", (("skipped_empty", "were empty"),
                                                ("dropped_long", f"were longer than data.seq_len={data_cfg.seq_len}")))
        if progress["train_prompts"] == 0:
            raise DataError(f"no training prompt in '{data_cfg.source}': {progress['skipped_empty']} were empty and "
                            f"{progress['dropped_long']} longer than data.seq_len={data_cfg.seq_len}; check "
                            "data.prompt_field, or raise data.seq_len")
        return {
            **facts.common_stats(),
            "format": "prompt",
            "train_on": "sampled completions",
            "train_prompts": progress["train_prompts"],
            "val_prompts": progress["val_prompts"],
            "skipped_empty": progress["skipped_empty"],
            "dropped_long": progress["dropped_long"],
            "skipped_non_text_parts": progress["non_text_parts"],
            "skipped_tools_unsupported": progress["tools_unsupported"],
            **self.token_stats(progress),
        }
