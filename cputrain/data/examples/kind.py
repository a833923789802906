"""Examples: chat, prompt/completion and Alpaca records, each tokenized whole with a mask of the
tokens that carry loss (the answers) and its length: a sequence kind (cputrain.data.sequences).
Tokenized by examples.tokenize; opened as examples.rows.ExampleData (packed without cross-talk,
or one example per row)."""

from __future__ import annotations

import logging
from pathlib import Path

from cputrain.config import DataConfig
from cputrain.data.examples import tokenize
from cputrain.data.examples.rows import ExampleData, open_examples
from cputrain.data.examples.tokenize import ExampleSpec
from cputrain.data.kind import BuildFacts
from cputrain.data.sequences import SequenceKind
from cputrain.errors import DataError

log = logging.getLogger("cputrain")


def train_on_choice(setting: str, data_format: str) -> tuple[str, str]:
    """data.train_on=auto for a resolved data.format, and why ("" when the config fixed it)."""
    if setting != "auto":
        return setting, ""
    if data_format == "chat":
        return "assistant", "chat: the assistant turns, each with the token that ends it"
    if data_format == "text":
        return "all", "text: every token (pretraining)"
    if data_format == "preference":
        return "completion", "preference: each answer and the token that ends it, not the prompt"
    if data_format == "feedback":
        return "completion", "feedback: the answer and the token that ends it, not the prompt"
    if data_format == "prompt":
        return "completion", "prompt: the completions sampled from each prompt, not the prompt"
    return "completion", f"{data_format}: the answer and EOS, not the prompt"


def example_spec(data_cfg: DataConfig, data_format: str, tokenizer) -> ExampleSpec:
    """How chat, prompt/completion or Alpaca records become examples for this tokenizer. A chat
    run's tokenizer takes the template it renders with, so the exported model/ carries it."""
    from cputrain.data import chat_template

    template = None
    if data_format == "chat":
        template = chat_template.template_of(tokenizer, data_cfg.chat_template)
        tokenizer.chat_template = template
    train_on = train_on_choice(data_cfg.train_on, data_format)[0]
    return ExampleSpec(data_format, data_cfg.messages_field, data_cfg.prompt_field, data_cfg.completion_field,
                       train_on, template, chat_template.template_variables(tokenizer) if template else {},
                       data_cfg.seq_len, data_cfg.truncation)


class ExampleKind(SequenceKind):
    what = "examples"
    worker_module = tokenize

    def __init__(self, data_cfg: DataConfig, data_format: str, tokenizer):
        self.spec = example_spec(data_cfg, data_format, tokenizer)
        self.tokenizer = tokenizer

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields every record must have (an Alpaca record's `input` may be missing)."""
        spec = self.spec
        if spec.format == "chat":
            return (spec.messages_field,)
        return tokenize.ALPACA_FIELDS if spec.format == "alpaca" else (spec.prompt_field, spec.completion_field)

    def open(self, folder: Path, data_cfg: DataConfig) -> ExampleData:
        return open_examples(folder, data_cfg.packing)

    def stats(self, facts: BuildFacts) -> dict:
        data_cfg, progress = facts.data_cfg, facts.progress
        if progress["non_text_parts"]:
            log.warning("data: %d conversation(s) of %s have content parts that are not text (images, audio) and "
                        "were left out (stats.json: skipped_non_text_parts)", progress["non_text_parts"],
                        data_cfg.source)
        if progress["tools_unsupported"]:
            log.warning("data: %d conversation(s) of %s have tool calls or tool results, which the chat template "
                        "does not write; they were left out (stats.json: skipped_tools_unsupported). Set "
                        "data.chat_template to a template that writes `tool_calls` (the built-in one does) to train "
                        "on them", progress["tools_unsupported"], data_cfg.source)
        if progress["train_examples"] == 0:
            raise DataError(
                f"no training example in '{data_cfg.source}': {progress['no_answer']} record(s) had no assistant turn "
                f"and {progress['dropped_long']} were longer than data.seq_len={data_cfg.seq_len} "
                "(data.truncation=drop); check data.format and its fields, or raise data.seq_len"
            )
        return {
            **facts.common_stats(),
            "format": self.spec.format,  # as resolved from auto
            "train_on": self.spec.train_on,
            "train_examples": progress["train_examples"],
            "val_examples": progress["val_examples"],
            "skipped_no_answer": progress["no_answer"],  # conversations with no assistant turn: nothing to learn
            "skipped_non_text_parts": progress["non_text_parts"],  # content with an image or audio part
            "skipped_tools_unsupported": progress["tools_unsupported"],  # tool calls the template cannot write
            "dropped_long": progress["dropped_long"],
            "truncated": progress["truncated"],
            **self.token_stats(progress),
        }
