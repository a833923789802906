"""Preference pairs with a shared prompt (data.shared_prompt): the same per-sequence
log-probabilities as the two sequences laid out whole, on both attention kernels and both heads;
no token of one pair sees another's; P as a plain loop finds it; the key resolved or refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cputrain.data.batch import IGNORE_INDEX
from cputrain.data.preference.rows import PairRows, shared_prefixes, shared_prompt_mask
from cputrain.objectives.preference import pair_logps, reference_table
from harness.run_cli_here import run_cli_here
from harness.tiny_run import tiny_overrides

VOCAB = 512  # the tiny tokenizer's


def _pair(prompt_c, answer_c, prompt_r, answer_r, trained_from_c=None, trained_from_r=None):
    """(ids, mask) of a pair's two sequences; the answers trained (or from the given indices)."""
    out = []
    for prompt, answer, first in ((prompt_c, answer_c, trained_from_c), (prompt_r, answer_r, trained_from_r)):
        ids = list(prompt) + list(answer)
        first = len(prompt) if first is None else first
        out.append((ids, [0] * first + [1] * (len(ids) - first)))
    return out


def _streams(pairs):
    ids = np.array([t for pair in pairs for seq, _ in pair for t in seq], dtype=np.uint16)
    mask = np.array([m for pair in pairs for _, seq in pair for m in seq], dtype=np.uint8)
    lengths = np.array([len(seq) for pair in pairs for seq, _ in pair], dtype=np.uint32)
    return ids, mask, lengths


def _string_pair(tok):
    """A string pair tokenized as the cache does (whole text, then prompt alone), whose two
    sequences part before one's first trained token: the prompt ends inside a word."""
    from cputrain.data import sequences
    from cputrain.data.preference.tokenize import PreferenceSpec

    spec = PreferenceSpec("prompt", "chosen", "rejected", None, {}, 256)
    sequences.init_worker(None, None, spec, tok.backend_tokenizer.to_str(), tok.eos_token_id, "uint16")
    for prompt, chosen, rejected in (("Hello wor", "ld", "ds"), ("The function retur", "ns a list of values", "n of the king"),
                                     ("Python is a progra", "mming language", "m that runs"),
                                     ("The modu", "le defines classes", "s of the object")):
        pair = [sequences.string_sequence(prompt, a) for a in (chosen, rejected)]
        (c, cm), (r, rm) = pair
        lcp = next(i for i, (a, b) in enumerate(zip(c, r)) if a != b)
        if 2 <= lcp < max(cm.index(1), rm.index(1)):
            return pair
    raise AssertionError("no string pair whose sequences part before the answer")


@pytest.fixture(scope="module")
def pairs(tiny_model_dir):
    from cputrain.data.tokenizer import load_tokenizer

    string = _string_pair(load_tokenizer(str(tiny_model_dir)))
    g = np.random.default_rng(0)
    words = lambda n: g.integers(3, VOCAB, n).tolist()  # noqa: E731
    prompt = words(7)
    return [
        _pair(prompt, words(4), prompt, words(6)),  # P = 7
        _pair([5, 9, 11], words(3), [5, 12, 11], words(2)),  # P = 1: nothing to share
        _pair([4] + words(3), words(2), [6] + words(3), words(3)),  # P = 0
        _pair([7, 8, 9, 10], [20, 21], [7, 8, 9, 10], [30], trained_from_c=2, trained_from_r=3),  # capped: P = 2
        string,  # parts before the chosen answer
        _pair(prompt[:3], words(5), prompt[:3], words(2)),  # P = 3
    ]


def _naive_prefix(c, cm, r, rm):
    n = 0
    while n < min(len(c), len(r)) and c[n] == r[n] and not cm[n] and not rm[n]:
        n += 1
    return n


def test_the_shared_prefix_is_the_loops_on_long_and_short_prompts():
    g = np.random.default_rng(1)
    pairs = []
    for _ in range(300):
        prompt = g.integers(0, 4, int(g.integers(0, 300))).tolist()  # few symbols: answers may start alike
        cut = [int(g.integers(0, len(prompt) + 1)) for _ in range(2)]
        pairs.append(_pair(prompt, g.integers(0, 4, int(g.integers(1, 9))).tolist(),
                           prompt[: max(cut)] + g.integers(0, 4, len(prompt) - max(cut)).tolist(),
                           g.integers(0, 4, int(g.integers(1, 9))).tolist(), trained_from_c=min(cut) or None))
    ids, mask, lengths = _streams(pairs)
    offsets = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))])
    got = shared_prefixes(ids, mask, offsets, lengths.astype(np.int64))
    want = [_naive_prefix(*pair[0], *pair[1]) for pair in pairs]
    assert got.tolist() == want
    assert max(want) > 96  # windows of 32, 64 and 128 tokens were crossed


def _model(implementation: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_shared_layout_gives_the_unshared_log_probabilities(pairs, implementation):
    from cputrain.kernels.chunked_head import install_chunked_loss

    model = _model(implementation)
    ids, mask, lengths = _streams(pairs)
    for packing in (True, False):
        unshared = PairRows(ids, mask, lengths, seq_len=48, packing=packing, pad_id=0)
        shared = PairRows(ids, mask, lengths, seq_len=48, packing=packing, pad_id=0, shared_prompt=True)
        assert shared.shared.tolist() == [6, 0, 0, 1, shared.shared[4], 2]  # P-1 where P ≥ 2, else 0
        assert shared.shared[4] >= 1 and shared.saved_tokens == int(shared.shared.sum())
        if packing:
            assert len(shared) < len(unshared) or shared.tokens < unshared.tokens
            assert shared.batch(range(len(shared))).input_ids.shape[0] == len(shared)
        b_u, b_s = unshared.batch(range(len(unshared))), shared.batch(range(len(shared)))
        assert b_s.attention_mask is not None and b_s.attention_mask.dtype == torch.bool
        if implementation == "eager":
            additive = b_s.model_inputs(model)["attention_mask"]
            assert additive.dtype == torch.float32 and additive.max() == 0  # as transformers' eager mask
        with torch.no_grad():
            want, want_n = pair_logps(model, b_u, chunked=False)
            got, got_n = pair_logps(model, b_s, chunked=False)
        assert torch.equal(want_n, got_n) and want_n.min() > 0
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        # DPO's reference table lines up sequence by sequence
        table = reference_table(model, shared, 2, _no_autocast)
        torch.testing.assert_close(table, reference_table(model, unshared, 2, _no_autocast), atol=1e-5, rtol=0)
        assert shared.prompt_ids(0) == list(pairs[0][0][0][:7])
    install_chunked_loss(model)  # the head a block at a time: each label's log-probability
    unshared = PairRows(ids, mask, lengths, seq_len=48, packing=True, pad_id=0)
    shared = PairRows(ids, mask, lengths, seq_len=48, packing=True, pad_id=0, shared_prompt=True)
    with torch.no_grad():
        want, _ = pair_logps(model, unshared.batch(range(len(unshared))), chunked=True)
        got, _ = pair_logps(model, shared.batch(range(len(shared))), chunked=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _no_autocast():
    import contextlib

    return contextlib.nullcontext()


def test_no_token_sees_another_pair(pairs):
    model = _model("sdpa")
    first, second = pairs[0], pairs[5]
    g = np.random.default_rng(2)

    def logps(a, b):
        ids, mask, lengths = _streams([a, b])
        rows = PairRows(ids, mask, lengths, seq_len=64, packing=True, pad_id=0, shared_prompt=True)
        assert len(rows) == 1  # the two pairs share one row
        with torch.no_grad():
            return pair_logps(model, rows.batch([0]), chunked=False)[0]

    def changed(pair):  # every token another, the lengths and masks kept
        return [([int(t) for t in g.integers(3, VOCAB, len(ids))], m) for ids, m in pair]

    base = logps(first, second)
    assert torch.equal(logps(first, changed(second))[:2], base[:2])  # pair 1 ignores pair 2
    after = logps(changed(first), second)
    torch.testing.assert_close(after[2:], base[2:], atol=1e-6, rtol=0)  # and pair 2 ignores pair 1
    assert not torch.allclose(after[:2], base[:2])


def test_the_mask_lets_rejected_see_its_prompt_and_padding_itself():
    seq = torch.tensor([[0, 0, 0, 0, 1, 1, -1]])
    visible = torch.tensor([[True, True, False, False, False, False, False]])
    mask = shared_prompt_mask(seq, visible)[0, 0]
    assert mask[4].tolist() == [True, True, False, False, True, False, False]  # prompt 0…P-2, not P-1 nor chosen
    assert mask[3].tolist() == [True, True, True, True, False, False, False]
    assert mask[6].tolist() == [False] * 6 + [True]


def _dense_mask(sequence_ids, visible_prompt):
    """The mask's definition, token against token: causal; a token sees its own sequence, a
    rejected one its pair's visible prompt; padding itself."""
    tokens = sequence_ids.shape[1]
    q, k = sequence_ids[:, :, None], sequence_ids[:, None, :]
    same = (q == k) & (q >= 0)
    prompt = (q >= 0) & (q % 2 == 1) & (k == q - 1) & visible_prompt[:, None, :]
    return ((same | prompt) & torch.ones(tokens, tokens, dtype=torch.bool).tril()
            | torch.eye(tokens, dtype=torch.bool))[:, None]


def test_the_block_mask_is_its_definition_on_packed_rows():
    g = np.random.default_rng(3)
    pairs = [_pair(p := g.integers(3, 50, int(g.integers(0, 9))).tolist(), g.integers(3, 50, 3).tolist(),
                   p[: int(g.integers(0, len(p) + 1))], g.integers(3, 50, 2).tolist()) for _ in range(40)]
    ids, mask, lengths = _streams(pairs)
    for packing in (True, False):
        rows = PairRows(ids, mask, lengths, seq_len=40, packing=packing, pad_id=0, shared_prompt=True)
        assert (rows.shared == 0).any() and (rows.shared > 2).any()
        batch = rows.batch(range(len(rows)))
        visible = torch.zeros_like(batch.sequence_ids, dtype=torch.bool)
        for i, r in enumerate(range(len(rows))):
            visible[i, : len(rows._row(r)[4])] = torch.from_numpy(rows._row(r)[4])
        assert torch.equal(batch.attention_mask, _dense_mask(batch.sequence_ids, visible))


def test_labels_and_positions_of_a_shared_pair():
    ids, mask, lengths = _streams([_pair([1, 2, 3, 4], [5, 6], [1, 2, 3, 4], [7, 8, 9])])
    batch = PairRows(ids, mask, lengths, seq_len=16, packing=True, pad_id=0, shared_prompt=True).batch([0])
    assert batch.input_ids[0, :10].tolist() == [1, 2, 3, 4, 5, 6, 4, 7, 8, 9]  # p_last copied
    assert batch.position_ids[0, :10].tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6]
    assert batch.sequence_ids[0, :10].tolist() == [0] * 6 + [1] * 4
    assert batch.labels[0, :10].tolist() == [IGNORE_INDEX] * 4 + [5, 6, IGNORE_INDEX, 7, 8, 9]


def test_shared_prompt_true_on_text_is_refused_in_one_line(tmp_path):
    proc = run_cli_here("train", *tiny_overrides(tmp_path / "run", tmp_path / "cache", **{"data.shared_prompt": "true"}))
    assert proc.returncode != 0 and "data.shared_prompt=true lays out preference pairs" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_dpo_folder_from_before_the_shared_prompt_resumes_with_it_off(tmp_path):
    import yaml

    from cputrain.config import Config
    from cputrain.errors import RunFolderError
    from cputrain.run_folder.layout import RunFolder
    from cputrain.run_folder.run_config import check_compatible, write_run_config

    def dpo(shared):
        return Config.model_validate({"data": {"source": "p.jsonl", "format": "preference", "shared_prompt": shared},
                                      "train": {"objective": "dpo"}})

    run = RunFolder(str(tmp_path / "run"))
    write_run_config(run, dpo(True), [])
    run.fs.makedirs(run.step_path(4), exist_ok=True)
    run.write_text("{}", "checkpoints", "step-000004", "trainer_state.json")
    check_compatible(run, dpo(True))
    with pytest.raises(RunFolderError, match="data.shared_prompt: True there, False now"):
        check_compatible(run, dpo(False))  # other rows, other pairs in each step
    recorded = yaml.safe_load(dpo(True).dump_yaml())
    del recorded["data"]["shared_prompt"]  # written before the key: its pairs were laid out whole
    run.write_text(yaml.safe_dump(recorded), "config.yaml")
    check_compatible(run, dpo(False))
    with pytest.raises(RunFolderError, match="set data.shared_prompt back"):
        check_compatible(run, dpo(True))


def test_auto_resumes_a_dpo_folder_with_the_layout_it_recorded(tmp_path):
    """data.shared_prompt=auto on a folder to resume takes what the folder recorded; a folder from
    before the key (no data.shared_prompt in its config.yaml) laid its pairs out whole: false."""
    import yaml

    from cputrain.config import Config
    from cputrain.config.resolve import Resolution
    from cputrain.training.choices import decide_data
    from cputrain.run_folder.layout import RunFolder
    from cputrain.run_folder.run_config import check_compatible, write_run_config

    out = tmp_path / "run"

    def decided(shared="auto"):
        cfg = Config.model_validate({"output_dir": str(out), "train": {"objective": "dpo"},
                                     "data": {"source": "p.jsonl", "format": "preference", "shared_prompt": shared}})
        res = decide_data(Resolution(cfg))
        return res.config, {key: (value, why) for key, value, why in res.reasons}

    cfg, reasons = decided()
    assert cfg.data.shared_prompt is True and "preference pairs" in reasons["data.shared_prompt"][1]  # nothing to resume
    run = RunFolder(str(out))
    write_run_config(run, decided(False)[0], [])
    run.fs.makedirs(run.step_path(4), exist_ok=True)
    run.write_text("{}", "checkpoints", "step-000004", "trainer_state.json")
    cfg, reasons = decided()
    assert cfg.data.shared_prompt is False and reasons["data.shared_prompt"][1].startswith("chosen when this run started")
    recorded = yaml.safe_load(decided(True)[0].dump_yaml())
    del recorded["data"]["shared_prompt"]  # a folder written before the key existed
    run.write_text(yaml.safe_dump(recorded), "config.yaml")
    cfg, reasons = decided()
    assert cfg.data.shared_prompt is False and "written before data.shared_prompt existed" in reasons["data.shared_prompt"][1]
    check_compatible(run, cfg)  # …and the folder's check lets it resume, without the override



LAYERS = 4  # of the masks' tiny sdpa Llama


@pytest.fixture(scope="module")
def sdpa_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        attn_implementation="sdpa"))


def _forward_backward(model, inputs: dict, width: int, autocast: bool) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(distinct storages of width² elements the forward keeps for the backward, the logits, one
    weight's gradient) of a forward and backward of `inputs`, under bf16 autocast or not."""
    storages = set()

    def pack(t):
        if t.shape[-2:] == (width, width):
            storages.add(t.untyped_storage().data_ptr())
        return t

    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(**inputs).logits
    logits.float().sum().backward()
    return len(storages), logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_sdpa_keeps_one_mask_for_every_layer_with_the_bool_masks_results(sdpa_llama, autocast):
    """A bool mask is converted by sdpa in every layer, and each layer keeps its copy for the
    backward; the additive one attention_mask_for gives (in the dtype the queries compute in) is
    the same tensor in every layer, and gives the bool mask's logits and gradients exactly."""
    from cputrain.data.batch import attention_mask_for

    width = 48
    ids = torch.randint(0, 64, (2, width), generator=torch.Generator().manual_seed(1))
    sequence_ids = torch.tensor([[0] * 16 + [1] * 12 + [2] * 12 + [3] * 8, [0] * 20 + [1] * 28])
    mask = shared_prompt_mask(sequence_ids, sequence_ids == 0, torch.zeros_like(sequence_ids))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        additive = attention_mask_for(mask, sdpa_llama)
    assert additive.dtype == (torch.bfloat16 if autocast else torch.float32)
    kept_bool, *of_bool = _forward_backward(sdpa_llama, {"input_ids": ids, "attention_mask": mask}, width, autocast)
    kept, *of_additive = _forward_backward(sdpa_llama, {"input_ids": ids, "attention_mask": additive}, width, autocast)
    assert kept_bool >= LAYERS, kept_bool  # sdpa's conversion, kept once per layer
    assert kept == 1, kept
    assert all(torch.equal(a, b) for a, b in zip(of_bool, of_additive))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_packed_examples_keep_one_mask_with_transformers_results(sdpa_llama, autocast):
    """Packed examples (positions restarting at each example, the padding after them its own run):
    transformers builds their mask from the positions as bool, which sdpa converts in every layer;
    Batch.model_inputs builds it once (packed_mask), additive, with transformers' logits and
    gradients exactly. A row of one sequence keeps the kernel's causal path (no mask)."""
    from cputrain.data.batch import Batch, packed_mask

    width = 40
    ids = torch.randint(0, 64, (2, width), generator=torch.Generator().manual_seed(1))
    positions = torch.stack([torch.cat([torch.arange(12), torch.arange(20), torch.arange(8)]),
                             torch.cat([torch.arange(30), torch.arange(10)])])
    batch = Batch(ids, ids.clone(), positions)

    def inputs(model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            given = batch.model_inputs(model)
        del given["labels"]
        return given

    kept_transformers, *of_transformers = _forward_backward(sdpa_llama, inputs(None), width, autocast)
    kept, *ours = _forward_backward(sdpa_llama, inputs(sdpa_llama), width, autocast)
    assert kept_transformers >= LAYERS, kept_transformers
    assert kept == 1, kept
    assert all(torch.equal(a, b) for a, b in zip(of_transformers, ours))
    assert packed_mask(torch.arange(width)[None].repeat(2, 1)) is None
