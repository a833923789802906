"""Unpaired feedback: one answer with a thumbs-up or a thumbs-down (TRL's unpaired preference: a
prompt, a completion and a boolean label), what KTO trains on. A sequence kind
(cputrain.data.sequences) with one more stream, each sequence's label: tokenized by
feedback.tokenize, opened as feedback.rows.FeedbackData (packed as examples are, each batch with
its KL sequences)."""

from __future__ import annotations

from pathlib import Path

from cputrain.config import DataConfig
from cputrain.data.feedback import tokenize
from cputrain.data.feedback.rows import FeedbackData, open_feedback
from cputrain.data.feedback.tokenize import FeedbackSpec
from cputrain.data.kind import BuildFacts
from cputrain.data.sequences import RecordsKind
from cputrain.errors import DataError


class FeedbackKind(RecordsKind):
    what = "feedback examples"
    worker_module = tokenize

    def spec_of(self, data_cfg: DataConfig, template: str | None, variables: dict) -> FeedbackSpec:
        return FeedbackSpec(data_cfg.prompt_field, data_cfg.completion_field, data_cfg.label_field, template,
                            variables, data_cfg.seq_len, data_cfg.truncation)

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields every record must have: the prompt may be missing (then it is in the completion)."""
        return self.spec.completion_field, self.spec.label_field

    def streams(self, token_dtype: str) -> dict[str, str]:
        return {**super().streams(token_dtype), "train.labels.bin": "uint8", "val.labels.bin": "uint8"}

    def open(self, folder: Path, data_cfg: DataConfig) -> FeedbackData:
        return open_feedback(folder, data_cfg.packing)

    def stats(self, facts: BuildFacts) -> dict:
        data_cfg, progress = facts.data_cfg, facts.progress
        self.warn_left_out(facts, "record(s)", (
            ("skipped_empty", "had an empty answer"),
            ("no_answer", "were conversations that do not end with an assistant turn"),
            ("dropped_long", f"were longer than data.seq_len={data_cfg.seq_len}")))
        if progress["train_examples"] == 0:
            raise DataError(
                f"no training example in '{data_cfg.source}': {progress['skipped_empty']} had an empty answer, "
                f"{progress['no_answer']} no closing assistant turn and {progress['dropped_long']} were longer than "
                f"data.seq_len={data_cfg.seq_len}; check the data's fields, or raise data.seq_len")
        return {
            **facts.common_stats(),
            "format": "feedback",
            "train_on": "completion",
            "train_examples": progress["train_examples"],
            "val_examples": progress["val_examples"],
            "desirable": progress["desirable"],
            "undesirable": progress["undesirable"],
            "val_desirable": progress["val_desirable"],
            "val_undesirable": progress["val_undesirable"],
            "skipped_empty": progress["skipped_empty"],
            "skipped_no_answer": progress["no_answer"],
            "skipped_non_text_parts": progress["non_text_parts"],
            "skipped_tools_unsupported": progress["tools_unsupported"],
            "dropped_long": progress["dropped_long"],
            "truncated": progress["truncated"],
            **self.token_stats(progress),
        }


def refuse_one_label(stats: dict, data_cfg: DataConfig) -> None:
    """Training data of one label only, refused where it is to be trained on (train, prepare): KTO
    learns from both kinds. Not in the cache's build: `eval` scores held-out feedback of any labels."""
    if stats.get("format") != "feedback":
        return
    for label, count, other in ((True, stats["desirable"], "false (undesirable)"),
                                (False, stats["undesirable"], "true (desirable)")):
        if count == stats["train_examples"]:
            raise DataError(
                f"every one of the {count} training examples of '{data_cfg.source}' has {data_cfg.label_field}="
                f"{str(label).lower()}: KTO learns from both kinds of answer; add examples with "
                f"{data_cfg.label_field}={other}")
