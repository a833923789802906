"""The chat template: which one a run uses, and rendering a conversation with it.

Rendering is transformers' own (`render_jinja_template`, what `apply_chat_template` calls), with
the tokenizer's special tokens as template variables, so a conversation is the text the model
will see from transformers pipelines and inference servers. The template is the tokenizer's
`chat_template`, or the file named by data.chat_template, or for a tokenizer without one (a
model built from scratch, whose tokenizer cputrain trains) the built-in ChatML template below.
Its two special tokens are in every tokenizer cputrain trains.

    <|im_start|>system
    You are terse.<|im_end|>
    <|im_start|>user
    What is a list?<|im_end|>
    <|im_start|>assistant
    A mutable sequence.<|im_end|>

An assistant turn is trained from after `<|im_start|>assistant\\n` through its `<|im_end|>` and
the newline after it: the model learns to end its turn, and generation stops at `<|im_end|>`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cputrain.errors import DataError, one_line

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Tool calls (an assistant turn's `tool_calls`) are written as Qwen2.5 and Hermes write them, one
# `<tool_call>{"name": …, "arguments": …}</tool_call>` per call after the turn's text; a tool's
# result is a turn of role `tool`. A conversation without tools renders exactly as plain ChatML.
BUILTIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n' + {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson"
    " + '\n</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The same template with each answer and its end token inside `{% generation %}` markers, for
# tools that find answers only through them (TRL's assistant_only_loss): cputrain trains the very
# same tokens with either (tests/unit/test_sft_vs_trl.py, benchmarks/sft_and_dpo/sft.py).
MARKED_CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ROLES = ("system", "user", "assistant", "tool")


def renders_tools(template: str) -> bool:
    """Whether a template writes tool calls: the templates that do (Llama 3.1, Qwen2.5, Mistral, the
    built-in one) all read the messages' `tool_calls`; one that does not would drop them silently."""
    return "tool_calls" in template


def content_text(content) -> str | None:
    """A message's content as text: a string, or the OpenAI form, a list of parts, whose text parts
    are joined with newlines (as vLLM does). None when a part is not text (an image, audio)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        return None
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            return None
    return "\n".join(texts)


def template_for_records(tokenizer, path: str | None) -> str | None:
    """The template conversational records (pairs, feedback) are rendered with, given to the
    tokenizer so the exported model/ carries it (as for chat examples); None where the tokenizer
    has none (string records never read it; a conversational one then says so)."""
    from cputrain.errors import DataError

    try:
        template = template_of(tokenizer, path)
    except DataError:
        return None
    tokenizer.chat_template = template
    return template


def template_of(tokenizer, template_file: str | None) -> str:
    """The template a run renders with: data.chat_template's file, the tokenizer's, or the built-in one."""
    if template_file:
        path = Path(template_file).expanduser()
        try:
            return path.read_text()
        except OSError as exc:
            raise DataError(f"data.chat_template '{template_file}' cannot be read ({exc.strerror}); "
                            "name a Jinja file") from None
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, str) and own:
        return own
    if IM_START not in tokenizer.get_vocab() or IM_END not in tokenizer.get_vocab():
        raise DataError("the tokenizer has no chat template and lacks the built-in template's tokens "
                        f"{IM_START} and {IM_END}; set data.chat_template to a Jinja file for this tokenizer")
    return BUILTIN_TEMPLATE


def template_variables(tokenizer) -> dict[str, str]:
    """What apply_chat_template passes a template besides the messages: the special tokens' text."""
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    return {name: str(getattr(tokenizer, name)) for name in names if getattr(tokenizer, name, None) is not None}


def render(template: str, messages: list[dict], variables: dict, add_generation_prompt: bool = False) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                            add_generation_prompt=add_generation_prompt, **variables)
    except Exception as exc:  # jinja's own message names the problem
        raise DataError(f"the chat template failed to render a conversation: {one_line(exc)}") from None
    return rendered[0]


ANSWER_MASK_RULE = "overlap"  # part of the token cache's key (cputrain.data.cache_key)


def answer_mask(offsets, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token that holds a character of an answer span, else 0. `offsets`: each token's
    (start, end) characters in the rendered text. A token the tokenizer merged across a span's
    edge (a template's newline and the spaces an indented answer starts with) is trained: it holds
    the answer's first characters, which the model must learn to write; TRL marks tokens the same
    way (transformers' assistant mask maps every answer character to its token)."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for a, b in spans:
        mask[(offsets[:, 0] < b) & (offsets[:, 1] > a)] = 1
    return mask


def assistant_spans(template: str, messages: list[dict], variables: dict) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    Turn i spans from the end of the conversation before it rendered with the generation prompt
    to the end of the conversation through it. A template that renders an earlier part of the
    conversation differently once more turns follow cannot be split so, and is refused.
    """
    text = render(template, messages, variables)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(template, messages[:i], variables, add_generation_prompt=True)
        # the last turn's "through" is the conversation itself: one render fewer for every
        # single-turn record (a third of a chat preparation's template time)
        through = text if i + 1 == len(messages) else render(template, messages[: i + 1], variables)
        if not (text.startswith(before) and text.startswith(through) and through.startswith(before)):
            raise DataError("the chat template renders the start of a conversation differently once more turns "
                            f"follow (turn {i + 1}), so the answers cannot be found in it; set data.chat_template "
                            "to a template whose rendering of a conversation starts with that of each prefix")
        spans.append((len(before), len(through)))
    return text, spans
