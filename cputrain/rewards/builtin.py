"""The built-in verifiable rewards, with TRL's signature f(prompts, completions, **columns):
`exact_answer` (the completion, stripped, equals the record's `answer` column), `starts_with_answer`
(the completion opens with it, case aside) and `regex:<pattern>` (the completion matches the
pattern from its start: a format reward)."""

from __future__ import annotations

import re


def completion_text(completion) -> str:
    """A completion as text: TRL hands conversational completions as [{"role": "assistant", "content": …}]."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return completion


def exact_answer(prompts, completions, answer=None, **columns) -> list[float]:
    """1.0 where the completion's text, stripped, is the record's `answer` (also stripped), else 0.0."""
    if answer is None:
        raise KeyError("answer")
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def starts_with_answer(prompts, completions, answer=None, **columns) -> list[float]:
    """1.0 where the completion's text, stripped, starts with the record's `answer`, case aside, else 0.0."""
    if answer is None:
        raise KeyError("answer")
    return [float(completion_text(c).strip().lower().startswith(str(a).strip().lower()))
            for c, a in zip(completions, answer)]


def regex_reward(pattern: str):
    """1.0 where the completion's text matches `pattern` from its start (re.match), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def matches(prompts, completions, **columns) -> list[float]:
        return [float(compiled.match(completion_text(c)) is not None) for c in completions]

    matches.__name__ = f"regex:{pattern}"
    return matches
