"""The real command, end to end: `python -m cputrain train` on a tiny model, then every file of
the run folder, the export loaded by plain transformers, generate, eval, doctor and --help."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.cli_env import cli_env
from harness.run_cli import run_cli
from harness.run_cli_here import run_cli_here
from harness.tiny_run import tiny_overrides

METRIC_FIELDS = {"step", "loss", "lr", "tokens_per_s", "mfu", "rss_gib"}
SUMMARY_FIELDS = {"final_loss", "val_loss", "tokens_per_s", "mfu", "peak_rss_gib", "wall_time_s"}


# train.profile_step rides along: the profile of a real step, at no extra training process
TINY_RUN = {"train.sample_tokens": 12, "train.profile_step": 2}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("cli") / "run"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **TINY_RUN), check=True)
    return out, proc


def test_run_folder_has_every_file(tiny_run):
    out, proc = tiny_run
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "memory.json", "loss.png", "sample.txt"):
        assert (out / name).is_file(), name
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "sample.txt").read_text().strip()
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == ["step-000005", "step-000010"]  # keep_last=2, no .tmp left
    for step in steps:
        folder = out / "checkpoints" / step
        assert (folder / "trainer_state.json").is_file() and (folder / "rng" / "rank-00000.pt").is_file()
        assert any((folder / "state").iterdir())
    state = json.loads((out / "checkpoints" / "step-000010" / "trainer_state.json").read_text())
    assert state["step"] == 10 and state["sequences_consumed"] == 80  # the data position


def test_the_profiled_step_leaves_its_summary_trace_and_line(tiny_run):
    out, proc = tiny_run
    profile = json.loads((out / "profile_step2.json").read_text())
    assert profile["step"] == 2 and profile["step_s"] > 0
    families = profile["families"]
    assert families["matmul"]["share"] > 0 and families["optimizer"]["share"] > 0
    assert families["attention"]["share"] > 0  # the run's sdpa kernel (tiny_overrides)
    assert sum(f["share"] for f in families.values()) == pytest.approx(1.0, abs=1e-6)
    assert profile["matmul_kernels"]["gflop_per_s"] > 0
    assert (out / "profile_step2.trace.json.gz").stat().st_size > 0
    lines = [line for line in proc.stderr.splitlines() if "profile of step" in line]
    assert len(lines) == 1 and "matmuls" in lines[0] and lines[0].endswith(f"written to {out}/profile_step2.json")


def test_resolved_config_records_reasons(tiny_run):
    out, _ = tiny_run
    text = (out / "config.yaml").read_text()
    assert "# parallel.strategy = single:" in text  # the reason for each auto choice
    cfg = yaml.safe_load(text)
    assert cfg["parallel"]["strategy"] == "single" and cfg["hardware"]["precision"] == "fp32"
    assert cfg["train"]["max_steps"] == 10 and cfg["data"]["seq_len"] == 32


def test_metrics_and_summary(tiny_run):
    out, proc = tiny_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 11))
    for r in train_rows:
        assert METRIC_FIELDS <= set(r)
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and 0 < r["rss_gib"] < 64 and r["lr"] > 0
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 2 and vals[-1] < vals[0]
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_FIELDS <= set(summary)
    assert summary["val_loss"] == pytest.approx(vals[-1]) and summary["final_loss"] == pytest.approx(train_rows[-1]["loss"])
    assert summary["peak_rss_gib"] > 0 and summary["wall_time_s"] > 0
    assert (summary["status"], summary["exit_code"], summary["reason"]) == ("finished", 0, None)
    # The end-of-run table goes to the log.
    assert "useful tokens/s" in proc.stderr + proc.stdout and "MFU" in proc.stderr + proc.stdout


LOAD_WITHOUT_CPUTRAIN = r"""
import sys
sys.modules["cputrain"] = None  # any import of cputrain now fails: the export must not need it
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = sys.argv[1]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder)
ids = tok("The list", return_tensors="pt")["input_ids"]
out = model(input_ids=ids, labels=ids)
assert torch.isfinite(out.loss), out.loss
print(type(model).__name__, len(tok), float(out.loss))
"""


def test_export_loads_with_plain_transformers(tiny_run):
    out, _ = tiny_run
    files = {p.name for p in (out / "model").iterdir()}
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in files)
    proc = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_CPUTRAIN, str(out / "model")], capture_output=True,
                          text=True, env=cli_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, vocab, loss = proc.stdout.split()
    assert name == "LlamaForCausalLM" and int(vocab) == 512 and math.isfinite(float(loss))


def _ids(value) -> set[int]:
    return set(value) if isinstance(value, (list, tuple)) else {value}


def test_export_generates_in_a_transformers_pipeline(tiny_run):
    """model/ as transformers' pipeline takes it, in this process: the class config.json names, the
    tokenizer's ids in the generation config (EOS, and the end of a chat turn), and new tokens."""
    from transformers import pipeline

    pipe = pipeline("text-generation", model=str(tiny_run[0] / "model"))
    tokenizer, generation = pipe.tokenizer, pipe.model.generation_config
    assert pipe.model.config.architectures == ["LlamaForCausalLM"]
    assert _ids(generation.eos_token_id) == {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert (generation.bos_token_id, generation.pad_token_id) == (tokenizer.bos_token_id, tokenizer.pad_token_id)
    prompt = tokenizer("The list")["input_ids"]
    out = pipe("The list", max_new_tokens=6, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    assert out[:len(prompt)] == prompt and len(out) > len(prompt)


# llama.cpp's converter ships with its sources (not with a package): where a checkout is named,
# it reads model/ as it reads a published model. Nothing is fetched here.
LLAMA_CPP_CONVERTER = Path(os.environ.get("LLAMA_CPP_DIR", "/nonexistent")) / "convert_hf_to_gguf.py"


@pytest.mark.skipif(not LLAMA_CPP_CONVERTER.is_file(), reason="no llama.cpp checkout (set LLAMA_CPP_DIR to one)")
def test_llama_cpp_s_converter_takes_the_model_class_from_the_export(tiny_run, tmp_path):
    proc = subprocess.run([sys.executable, str(LLAMA_CPP_CONVERTER), str(tiny_run[0] / "model"), "--outtype", "f32",
                           "--outfile", str(tmp_path / "model.gguf")], capture_output=True, text=True, env=cli_env(),
                          timeout=300)
    log = proc.stdout + proc.stderr
    assert "Model architecture: LlamaForCausalLM" in log, log[-3000:]
    # It knows a BPE's pre-tokenizer by a hash of the ids of a probe text, so a tokenizer trained
    # here is never among them: the converter may stop there, past the model class (`cputrain
    # export RUN --gguf` names the pre-tokenizer from tokenizer.json instead).
    assert proc.returncode == 0 or "pre-tokenizer was not recognized" in log, log[-3000:]


def test_generate_from_run_and_model_folder(tiny_run):
    out, _ = tiny_run
    a = run_cli("generate", out, "--prompt", "The list", "--max-new-tokens", "8", "--seed", "3", check=True)
    b = run_cli("generate", out / "model", "--prompt", "The list", "--max-new-tokens", "8", "--seed", "3", check=True)
    assert a.stdout.startswith("The list") and len(a.stdout.strip()) > len("The list")
    assert a.stdout == b.stdout  # same model, same seed


def test_eval_reports_loss_and_perplexity(tiny_run):
    out, _ = tiny_run
    proc = run_cli("eval", out, check=True)
    result = json.loads(proc.stdout)
    assert result["sequences"] > 0 and result["split"] == "val"
    assert result["val_ppl"] == pytest.approx(math.exp(result["val_loss"]), rel=1e-6)
    summary = json.loads((out / "summary.json").read_text())
    assert result["val_loss"] < math.log(512)  # better than uniform over the vocabulary
    assert abs(result["val_loss"] - summary["val_loss"]) < 0.5  # same model, same held-out text


def test_a_finished_run_is_not_retrained(tiny_run, cache_dir):
    out, _ = tiny_run
    before = (out / "metrics.jsonl").read_text()
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **TINY_RUN), check=True)
    assert "already complete" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("args", [[], ["train"], ["doctor"], ["generate"], ["eval"]], ids=lambda a: a[0] if a else "top")
def test_help_at_every_level(args):
    proc = run_cli_here(*args, "--help", check=True)
    assert proc.stdout.startswith("usage: cputrain")
    words = {"train": "key=value", "doctor": "--json", "generate": "--prompt", "eval": "--split"}
    if args:
        assert words[args[0]] in proc.stdout and "--debug" in proc.stdout
    else:
        for command in ("train", "doctor", "generate", "eval"):
            assert command in proc.stdout


def test_help_config_lists_every_key():
    proc = run_cli_here("train", "--help-config", check=True)
    for key in ("train.max_steps", "data.seq_len", "hardware.precision", "model.trust_remote_code"):
        assert key in proc.stdout


def test_doctor_prints_hardware_and_auto_choices():
    proc = run_cli("doctor", check=True)
    for word in ("physical", "NUMA", "amx_bf16=", "avx512_bf16=", "avx2=", "gloo=", "peak fp32", "FLOP/cycle",
                 "hardware.precision ="):
        assert word in proc.stdout, word
    # The JSON form in this process, reading the peaks the command above just timed (timing them
    # again is the same code and ~5 s of matmuls).
    from functools import partial
    from unittest import mock

    from cputrain.metrics import measured_peak

    with mock.patch.object(measured_peak, "machine_peaks", partial(measured_peak.machine_peaks, remeasure=False)):
        facts = json.loads(run_cli_here("doctor", "--json", check=True).stdout)
    assert facts["auto"]["hardware.precision"]["value"] in ("fp32", "bf16") and facts["flags"]
    for precision, peak in facts["measured_peak_flops"].items():
        assert f"measured {precision:<5} {peak['flops'] / 1e9:9.1f} GFLOP/s" in proc.stdout


# Not `alone`: the demo's own settings (threads = every core) beside the other worker's test change
# its speed, not what it learns (nothing here is timed); alone, the other worker idled through it.
@pytest.mark.fresh_interpreter  # the one command of `make demo`, exactly as a user starts it
def test_default_run_learns_and_leaves_plot_and_sample(tmp_path, cache_dir):
    """`cputrain train` with no config (the built-in demo: its model, corpus, tokenizer and
    sequence length), shortened to 30 steps of 8 sequences to keep the suite fast."""
    out = tmp_path / "default"
    run_cli("train", f"output_dir={out}", f"data.cache_dir={cache_dir}", "train.max_steps=30",
            "train.global_batch_size=8", "train.warmup_steps=5", "train.eval_every=10", "train.eval_batches=2",
            "train.checkpoint_every=30", "train.sample_tokens=20", check=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0] - 0.1, vals
    assert losses[-1] < losses[0]
    assert vals[-1] < math.log(4096) - 1  # well below a uniform guess over the 4096-token vocabulary
    assert (out / "loss.png").stat().st_size > 1000 and (out / "sample.txt").read_text().strip()
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["data"]["source"] == "builtin:pydoc" and cfg["model"]["name_or_path"] is None
    assert cfg["data"]["seq_len"] == 256 and cfg["model"]["arch"]["hidden_size"] == 256
