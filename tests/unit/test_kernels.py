"""The compute paths chosen for speed give the plain path's results: the chunked head + loss,
the two attention kernels timed by attn_implementation=auto, the measured peak's cache, fused AdamW."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from cputrain.kernels import attention_choice, chunked_loss
from cputrain.kernels.chunked_head import install_chunked_loss
from cputrain.metrics import measured_peak


def _tiny_model(tied: bool = True):
    torch.manual_seed(0)
    cfg = CONFIG_MAPPING["llama"](hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=512, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def _loss_and_grads(model, tokens, labels, dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = model(input_ids=tokens, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype,loss_tol,grad_tol", [(None, 1e-6, 1e-5), (torch.bfloat16, 1e-3, 2e-2)])
def test_chunked_loss_matches_the_plain_head(monkeypatch, tied, dtype, loss_tol, grad_tol):
    monkeypatch.setattr(chunked_loss, "BLOCK_BYTES", 4 * 512 * 20)  # 20 rows a block: several blocks
    monkeypatch.setattr(chunked_loss, "MIN_ROWS", 8)
    plain = _tiny_model(tied)
    chunked = copy.deepcopy(plain)
    install_chunked_loss(chunked)
    tokens = torch.randint(0, 512, (3, 33), generator=torch.Generator().manual_seed(1))
    labels = tokens.clone()
    labels[0, 5:9] = -100  # ignored positions are left out of the mean, as in transformers
    ref_loss, ref_grads = _loss_and_grads(plain, tokens, labels, dtype)
    got_loss, got_grads = _loss_and_grads(chunked, tokens, labels, dtype)
    assert got_loss == pytest.approx(ref_loss, rel=loss_tol)
    for name, ref in ref_grads.items():
        err = ((got_grads[name] - ref).norm() / ref.norm()).item()
        assert err <= grad_tol, f"{name}: gradient differs by {err:.2e} (relative norm)"


def _sequence_logps_and_grads(model, tokens, labels, dtype, block_wise: bool):
    """Each sequence's summed log-probability (two sequences a row), and the gradients of a loss
    that weighs the sequences differently, as DPO's does."""
    from cputrain.objectives.preference_loss import sequence_logps, sums_by_sequence

    sequence_ids = torch.zeros_like(tokens)
    sequence_ids[:, 15:] = 1
    sequence_ids += 2 * torch.arange(len(tokens))[:, None]
    weights = torch.linspace(-1.5, 2.0, 2 * len(tokens))
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        if block_wise:
            token_logps = model(input_ids=tokens, labels=labels, token_logps=True).token_logps
            sums, counts = sums_by_sequence(token_logps, labels, sequence_ids, 2 * len(tokens))
        else:
            sums, counts = sequence_logps(model(input_ids=tokens).logits, labels, sequence_ids, 2 * len(tokens))
    (sums * weights).sum().backward()
    return sums.detach(), counts, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("frozen_head", [False, True])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype,logp_tol,grad_tol", [(None, 1e-5, 1e-5), (torch.bfloat16, 1e-2, 2e-2)])
def test_block_wise_token_logps_match_the_plain_head(monkeypatch, tied, frozen_head, dtype, logp_tol, grad_tol):
    """Preference objectives' log-probabilities through the block-wise head (kernels/chunked_logps.py):
    the plain head's sums per sequence and gradients, with several blocks, ignored labels and a
    head that trains or is frozen (LoRA)."""
    monkeypatch.setattr(chunked_loss, "BLOCK_BYTES", 4 * 512 * 20)  # 20 rows a block: several blocks
    monkeypatch.setattr(chunked_loss, "MIN_ROWS", 8)
    plain = _tiny_model(tied)
    if frozen_head:
        plain.get_output_embeddings().weight.requires_grad_(False)
    block_wise = copy.deepcopy(plain)
    install_chunked_loss(block_wise)
    tokens = torch.randint(0, 512, (3, 33), generator=torch.Generator().manual_seed(1))
    labels = tokens.clone()
    labels[:, :4] = -100  # each row's prompt is not trained
    labels[1, 15:20] = -100
    ref_sums, ref_counts, ref_grads = _sequence_logps_and_grads(plain, tokens, labels, dtype, False)
    got_sums, got_counts, got_grads = _sequence_logps_and_grads(block_wise, tokens, labels, dtype, True)
    assert torch.equal(got_counts, ref_counts)
    assert torch.allclose(got_sums, ref_sums, rtol=logp_tol, atol=logp_tol * 10)
    assert got_grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        err = ((got_grads[name] - ref).norm() / ref.norm()).item()
        assert err <= grad_tol, f"{name}: gradient differs by {err:.2e} (relative norm)"


def test_chunked_model_still_gives_logits_and_eval_loss():
    plain = _tiny_model()
    chunked = copy.deepcopy(plain)
    install_chunked_loss(chunked)
    tokens = torch.randint(0, 512, (2, 17))
    with torch.no_grad():
        assert torch.equal(chunked(input_ids=tokens).logits, plain(input_ids=tokens).logits)
        assert chunked(input_ids=tokens, labels=tokens).loss.item() == pytest.approx(
            plain(input_ids=tokens, labels=tokens).loss.item(), rel=1e-6)


def test_block_rows_bound_the_fp32_logits():
    assert chunked_loss.block_rows(8192) == 8192
    assert chunked_loss.block_rows(128_256) * 128_256 * 4 <= chunked_loss.BLOCK_BYTES  # Llama-3's vocabulary
    assert chunked_loss.block_rows(10**6) == chunked_loss.MIN_ROWS  # never fewer rows than the floor


def test_the_two_attention_kernels_agree():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 16, generator=gen)
    k, v = torch.randn(2, 2, 24, 16, generator=gen), torch.randn(2, 2, 24, 16, generator=gen)
    assert torch.allclose(attention_choice._sdpa(q, k, v), attention_choice._eager(q, k, v), atol=1e-5)


def test_attention_choice_is_the_faster_and_says_why(monkeypatch):
    times = {attention_choice._sdpa: 0.2, attention_choice._eager: 0.1}
    monkeypatch.setattr(attention_choice, "time_forward_backward", lambda fn, *a: times[fn])
    cfg = CONFIG_MAPPING["llama"](hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    choice = attention_choice.attention_choice(cfg, micro_batch=2, seq_len=32, dtype=torch.bfloat16)
    assert choice.implementation == "eager"
    assert "eager 100.0 ms" in choice.reason and "sdpa 200.0 ms" in choice.reason and "2×4 heads (2 KV)×32×16" in choice.reason
    assert "1 alternated round" in choice.reason  # 2× apart: the first round settles it


def test_attention_choice_keeps_each_kernels_fastest_and_takes_eager_only_well_ahead(monkeypatch):
    """Noisy timings (one slow eager round, one fast sdpa round) give the same choice as quiet
    ones; a tie, or eager ahead by less than the margin, is sdpa; eager well ahead is eager."""
    cfg = CONFIG_MAPPING["llama"](hidden_size=64, num_attention_heads=4, num_key_value_heads=2)

    def choose(sdpa_ms, eager_ms):
        rounds = {attention_choice._sdpa: iter(sdpa_ms), attention_choice._eager: iter(eager_ms)}
        monkeypatch.setattr(attention_choice, "time_forward_backward", lambda fn, *a: next(rounds[fn]) / 1e3)
        return attention_choice.attention_choice(cfg, micro_batch=2, seq_len=32, dtype=torch.float32)

    noisy = choose([46.0, 47.2, 37.1], [55.1, 35.1, 34.2])  # round 1 alone: sdpa, round 2 alone: eager
    assert noisy.implementation == "sdpa" and "sdpa 37.1 ms, eager 34.2 ms" in noisy.reason
    assert "3 alternated round" in noisy.reason and "only where it is ≥ 10% faster" in noisy.reason
    assert choose([41.0, 41.5, 42.0], [40.0, 43.0, 42.8]).implementation == "sdpa"
    assert choose([50.0, 49.0, 51.0], [52.0, 40.0, 41.0]).implementation == "eager"  # 49 ≥ 1.1 × 40


def test_measured_peak_is_cached_and_keeps_the_best(monkeypatch, tmp_path):
    monkeypatch.setenv("CPUTRAIN_CACHE_HOME", str(tmp_path))
    rates = iter([5e9, 3e9, 7e9])
    monkeypatch.setattr(measured_peak, "measure", lambda dtype: (next(rates), 1024))
    args = ("Test CPU", {"avx2": True}, 2, torch.float32)
    assert measured_peak.measured_peak_flops(*args)[0] == 5e9
    assert measured_peak.measured_peak_flops(*args)[0] == 5e9  # cached: not timed again
    assert measured_peak.measured_peak_flops(*args, remeasure=True)[0] == 5e9  # 3e9 read low: kept 5e9
    assert measured_peak.measured_peak_flops(*args, remeasure=True)[0] == 7e9


def test_measure_grows_the_matmul_until_it_takes_long_enough(monkeypatch):
    sizes = []

    def fake(n, dtype, repeats=3):
        sizes.append(n)
        return 2 * n**3 / (0.3 if n >= 2048 else 0.01)  # 2048³ takes 0.3 s

    monkeypatch.setattr(measured_peak, "time_matmul", fake)
    flops, n = measured_peak.measure(torch.float32)
    assert n == 2048 and sizes[:3] == [512, 1024, 2048] and flops == pytest.approx(2 * 2048**3 / 0.3)


def test_adamw_is_fused():
    from cputrain.config import TrainConfig
    from cputrain.parallel.adamw import build_adamw

    opt = build_adamw(torch.nn.Linear(4, 4), TrainConfig())
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]


def test_doctor_names_intel_openmp_where_the_wheel_put_it(monkeypatch, tmp_path):
    from cputrain.native import libs as native_libs

    monkeypatch.setattr(native_libs.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(native_libs.sys, "base_prefix", str(tmp_path))
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    assert native_libs.find_intel_openmp() is None
    assert "pip install intel-openmp" in native_libs.report_lines()[1]
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    assert native_libs.find_intel_openmp() == str(tmp_path / "lib" / "libiomp5.so")
    assert str(tmp_path / "lib" / "libiomp5.so") in native_libs.report_lines()[1]
