"""cputrain's SFT examples against TRL's SFTTrainer preprocessing, on the same tokenizer, template
and records: the token ids and the trained-token masks are equal. Runs where TRL is installed
(the `sft-peer` extra, part of the test install).

TRL finds answers only through `{% generation %}` markers (assistant_only_loss); cputrain finds
them from the rendering and needs no markers. The chat case therefore uses a ChatML template with
markers around each answer and its end-of-turn token: on it both must agree. TRL trains the end
token only where the template puts it inside the markers; cputrain always trains it."""

from __future__ import annotations

import numpy as np
import pytest

from cputrain.data import chat_template
from cputrain.data.chat_template import MARKED_CHATML
from cputrain.data.examples.tokenize import ExampleSpec

trl = pytest.importorskip("trl")



@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from cputrain.data.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def _records(kind: str) -> list[dict]:
    from pydoc_data.topics import topics

    out = []
    for i, name in enumerate(sorted(topics)[:24]):
        answer = " ".join(topics[name].split())[: 30 + 40 * (i % 4)]
        if kind == "chat":
            if i % 4 == 1:  # an indented answer: the template's newline and its spaces merge into one token
                answer = "    " + answer
            messages = [{"role": "user", "content": f"What is {name}?"}, {"role": "assistant", "content": answer}]
            if i % 3 == 0:
                messages = [{"role": "system", "content": "Be brief."}, *messages,
                            {"role": "user", "content": "More?"}, {"role": "assistant", "content": "No more."}]
            out.append({"messages": messages})
        else:
            # half the prompts end in a space that the answer's first word takes when tokenized whole
            out.append({"prompt": f"Question: what is {name}?\nAnswer:" + " " * (i % 2),
                        "completion": ("" if i % 2 else " ") + answer})
    return out


def _cputrain(tok, kind, records, template=None):
    import datasets

    from cputrain.data import sequences
    from cputrain.data.examples import tokenize as tokenize_examples

    fmt, train_on = ("chat", "assistant") if kind == "chat" else ("prompt_completion", "completion")
    spec = ExampleSpec(fmt, "messages", "prompt", "completion", train_on, template,
                       chat_template.template_variables(tok) if template else {}, 10_000, "drop")
    sequences.init_worker(None, datasets.Dataset.from_list(records), spec, tok.backend_tokenizer.to_str(),
                          tok.eos_token_id, "uint32")
    chunk = tokenize_examples.tokenize_rows(0, len(records), np.zeros(len(records), bool))
    bounds = np.concatenate([[0], np.cumsum(chunk.parts["train.lengths.bin"], dtype=np.int64)])
    return [(chunk.parts["train.bin"][a:b].tolist(), chunk.parts["train.mask.bin"][a:b].tolist())
            for a, b in zip(bounds, bounds[1:])]


def _trl(tok, kind, records, model_dir, tmp_path, template=None):
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    if template:
        tok.chat_template = template
    args = SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], max_length=None, packing=False,
                     assistant_only_loss=kind == "chat", completion_only_loss=kind != "chat", use_cpu=True)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                         train_dataset=datasets.Dataset.from_list(records), processing_class=tok)
    # TRL folds its assistant / completion mask into the labels: -100 where a token is not trained
    return [(r["input_ids"], [int(label != -100) for label in r["labels"]]) for r in trainer.train_dataset]


def test_chat_ids_and_masks_equal_trl(tok, tiny_model_dir, tmp_path):
    records = _records("chat")
    ours = _cputrain(tok, "chat", records, MARKED_CHATML)
    theirs = _trl(tok, "chat", records, tiny_model_dir, tmp_path, MARKED_CHATML)
    assert len(ours) == len(theirs) == len(records)
    for i, ((ids, mask), (trl_ids, trl_mask)) in enumerate(zip(ours, theirs)):
        assert ids == trl_ids, f"record {i}: token ids differ"
        assert mask[1:] == trl_mask[1:], f"record {i}: trained tokens differ"  # the first token is never a target
        assert sum(mask) > 0
    # the rule is exercised: some token spans the template's newline and the answer's first spaces
    indented = [i for i, r in enumerate(records)
                if any(m["role"] == "assistant" and m["content"].startswith(" ") for m in r["messages"])]
    assert indented and any("\n " in tok.decode([t]) for i in indented for t in ours[i][0]), "no token spans the edge"


def test_prompt_completion_ids_and_masks_equal_trl(tok, tiny_model_dir, tmp_path):
    records = _records("prompt_completion")
    ours = _cputrain(tok, "prompt_completion", records)
    theirs = _trl(tok, "prompt_completion", records, tiny_model_dir, tmp_path)
    for i, ((ids, mask), (trl_ids, trl_mask)) in enumerate(zip(ours, theirs)):
        assert ids == trl_ids, f"record {i}: token ids differ"
        assert mask[1:] == trl_mask[1:], f"record {i}: trained tokens differ"
        assert ids[-1] == tok.eos_token_id and mask[-1] == 1  # the answer's EOS is trained by both
