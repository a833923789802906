"""cputrain's preference pairs against TRL's DPOTrainer preprocessing, on the same tokenizer,
template and records: each pair's chosen and rejected sequences are TRL's prompt + answer ids, and
the trained tokens are TRL's answer tokens; then the summed log-probabilities cputrain takes from a
packed batch equal those of TRL's sequences through the same model, one at a time. Runs where TRL
is installed (the `sft-peer` extra, part of the test install)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cputrain.data import chat_template, sequences
from cputrain.data.preference import tokenize as tokenize_preferences
from cputrain.data.preference.rows import PairRows
from cputrain.data.preference.tokenize import PreferenceSpec
from cputrain.objectives.preference_loss import sequence_logps

trl = pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from cputrain.data.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def _records(kind: str) -> list[dict]:
    from pydoc_data.topics import topics

    names = sorted(topics)[:12]
    answers = [" ".join(topics[n].split())[: 30 + 30 * (i % 3)] for i, n in enumerate(names)]
    out = []
    for i, name in enumerate(names):
        chosen, rejected = answers[i], answers[(i + 1) % len(names)]
        if kind == "chat":
            out.append({"prompt": [{"role": "user", "content": f"What is {name}?"}],
                        "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            out.append({"prompt": f"Question: what is {name}?\nAnswer:", "chosen": " " + chosen,
                        "rejected": " " + rejected})
    return out


def _cputrain(tok, records):
    import datasets

    template = chat_template.template_of(tok, None)
    spec = PreferenceSpec("prompt", "chosen", "rejected", template, chat_template.template_variables(tok), 10_000)
    sequences.init_worker(None, datasets.Dataset.from_list(records), spec, tok.backend_tokenizer.to_str(),
                          tok.eos_token_id, "uint32")
    chunk = tokenize_preferences.tokenize_rows(0, len(records), np.zeros(len(records), bool))
    return chunk.parts["train.bin"], chunk.parts["train.mask.bin"], chunk.parts["train.lengths.bin"]


def _trl(tok, records, model, tmp_path):
    import datasets
    from trl import DPOConfig, DPOTrainer

    tok.chat_template = chat_template.template_of(tok, None)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], max_length=None, use_cpu=True)
    trainer = DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                         processing_class=tok)
    return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in trainer.train_dataset]


@pytest.mark.parametrize("kind", ["strings", "chat"])
def test_pairs_and_logps_equal_trls(tok, tiny_model_dir, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    records = _records(kind)
    ids, mask, lengths = _cputrain(tok, records)
    theirs = _trl(tok, records, model, tmp_path)
    bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    sequences = [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(bounds, bounds[1:])]
    assert len(sequences) == 2 * len(theirs) == 2 * len(records)
    expected = []
    for i, (prompt, chosen, rejected) in enumerate(theirs):
        for j, answer in enumerate((chosen, rejected)):
            seq_ids, seq_mask = sequences[2 * i + j]
            assert seq_ids == prompt + answer, f"pair {i}, sequence {j}: token ids differ"
            assert seq_mask[1:] == ([0] * len(prompt) + [1] * len(answer))[1:], f"pair {i}, sequence {j}: mask"
            with torch.no_grad():  # TRL's sum: log p of each answer token, the sequence alone
                full = torch.tensor([prompt + answer])
                logp = torch.log_softmax(model(full).logits[0, :-1].float(), -1)
                targets = full[0, 1:]
                expected.append(float(logp.gather(-1, targets[:, None])[len(prompt) - 1:].sum()))
    rows = PairRows(ids, mask, lengths, seq_len=2 * int(lengths.max()) + 64, packing=True, pad_id=0)
    got = []
    for r in range(len(rows)):
        batch = rows.batch([r])
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        got += sequence_logps(logits, batch.labels, batch.sequence_ids, 2 * batch.pairs)[0].tolist()
    assert len(rows) < len(records)  # several pairs share a row
    assert np.allclose(got, expected, atol=1e-4), np.abs(np.array(got) - expected).max()
