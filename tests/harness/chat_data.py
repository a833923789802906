"""A chat file for fine-tuning tests, written from Python's own documentation."""

from __future__ import annotations

import json
from pathlib import Path


def write_chat_file(path: Path) -> Path:
    """Conversations of very different lengths (answers of a few words to a few paragraphs), some
    with a system prompt and two turns, so micro-batches hold different numbers of trained tokens."""
    from pydoc_data.topics import topics

    with open(path, "w") as f:
        for i, name in enumerate(sorted(topics)):
            paragraphs = [" ".join(p.split()) for p in topics[name].split("\n\n") if len(p.strip()) > 40]
            answer = " ".join(paragraphs[: 1 + i % 3])[: 40 + 60 * (i % 5)]
            messages = [{"role": "user", "content": f"What is {name}?"}, {"role": "assistant", "content": answer}]
            if i % 3 == 0:
                messages = [{"role": "system", "content": "Answer briefly."}] + messages + [
                    {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path
