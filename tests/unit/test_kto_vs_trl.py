"""cputrain's unpaired feedback against TRL's KTOTrainer preprocessing, on the same tokenizer,
template and records: each example's sequence is TRL's prompt + completion ids with its
completion trained, each KL sequence TRL's prompt + KL completion (TRL's neighbour in one batch
of the whole data is cputrain's neighbour in the data); then the summed log-probabilities
cputrain takes from packed rows equal those of TRL's sequences through the same model, one at a
time. Runs where TRL is installed (the `sft-peer` extra, part of the test install)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cputrain.data import chat_template
from cputrain.objectives.sequence_sums import summed_logps
from harness.feedback_rows import feedback_rows

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from cputrain.data.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def _records(kind: str) -> list[dict]:
    from pydoc_data.topics import topics

    names = sorted(topics)[:8]
    out = []
    for i, name in enumerate(names):
        answer = " ".join(topics[names[(i + i % 2) % len(names)]].split())[: 30 + 30 * (i % 3)]
        if kind == "chat":
            out.append({"prompt": [{"role": "user", "content": f"What is {name}?"}],
                        "completion": [{"role": "assistant", "content": answer}], "label": i % 3 != 1})
        else:
            out.append({"prompt": f"Question: what is {name}?\nAnswer:", "completion": " " + answer,
                        "label": i % 3 != 1})
    return out


def _trl(tok, records, model, tmp_path):
    import datasets
    from trl import KTOConfig, KTOTrainer

    tok.chat_template = chat_template.template_of(tok, None)
    args = KTOConfig(output_dir=str(tmp_path / "trl"), report_to=[], max_length=None, use_cpu=True,
                     per_device_train_batch_size=len(records))  # one batch: its KL rotation is over all of them
    trainer = KTOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                         processing_class=tok)
    return [(r["prompt_ids"], r["completion_ids"], r["KL_completion_ids"], r["label"]) for r in trainer.train_dataset]


def _logps(model, ids: list[int], start: int) -> float:
    """TRL's sum: log p of each completion token, the sequence alone."""
    with torch.no_grad():
        full = torch.tensor([ids])
        logp = torch.log_softmax(model(full).logits[0, :-1].float(), -1)
        return float(logp.gather(-1, full[0, 1:, None])[start - 1:].sum())


@pytest.mark.parametrize("kind", ["strings", "chat"])
def test_feedback_kl_sequences_and_logps_equal_trls(tok, tiny_model_dir, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    records = _records(kind)
    rows, ours = feedback_rows(tok, records, packing=True, seq_len=1024)
    theirs = _trl(tok, records, model, tmp_path)
    assert len(ours) == len(theirs) == len(records)
    expected, expected_kl = [], []
    for e, (prompt, completion, kl_completion, label) in enumerate(theirs):
        ids, mask = ours[e]
        assert ids == prompt + completion, f"example {e}: token ids differ"
        assert mask[1:] == ([0] * len(prompt) + [1] * len(completion))[1:], f"example {e}: mask"
        assert bool(rows.labels[e]) == label
        kl_ids, kl_mask = rows.kl_sequence(e)
        assert kl_ids.tolist() == prompt + kl_completion, f"example {e}: KL sequence differs"
        assert kl_mask.tolist() == [0] * len(prompt) + [1] * len(kl_completion)
        expected.append(_logps(model, prompt + completion, len(prompt)))
        expected_kl.append(_logps(model, prompt + kl_completion, len(prompt)))
    batch = rows.batch(np.arange(len(rows)))
    assert len(rows) < len(records)  # several examples share a row
    with torch.no_grad():
        got = summed_logps(model, batch, False, batch.examples)[0].tolist()
        got_kl = summed_logps(model, batch.kl, False, batch.examples)[0].tolist()
    assert np.allclose(got, expected, atol=1e-4), np.abs(np.array(got) - expected).max()
    assert np.allclose(got_kl, expected_kl, atol=1e-4), np.abs(np.array(got_kl) - expected_kl).max()
