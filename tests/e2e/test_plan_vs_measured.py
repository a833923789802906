"""`cputrain plan` against real runs: state bytes exactly, peak RSS within ±15%.

Two model sizes (a tiny Llama and one of about 100M parameters), 1 and 2 ranks, every
strategy available here; 2 short steps each. Each layout runs once: the one-rank shards at the
tiny size (where the runtime's own memory dominates), every layout of 2 ranks at ~100M (where the
state does), and there FSDP's gather_once too (every block gathered and, over two micro-batches,
every gradient unsharded through the step: the FSDP layout one node runs whose buffers differ
most). plan.json (written by
`cputrain train` at start)
is compared with the "training step peak" phase of memory.json, and also checked against
what `cputrain plan --json` prints for the same config before any run. LoRA runs the same
way on a pretrained base (a model folder): single, ddp and fsdp, the base frozen in bf16 (and
in fp32 once); `pytest -s` prints each run's rows.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from harness.run_cli import run_cli
from harness.run_cli_here import run_cli_here
from cputrain.plan.memory.compare import EXACT, RSS_TOLERANCE, compare_run, markdown_table

SIZES = {
    "tiny": ["model.arch.hidden_size=64", "model.arch.intermediate_size=128", "model.arch.num_hidden_layers=2",
             "model.arch.num_attention_heads=4", "model.arch.num_key_value_heads=2", "model.tokenizer_vocab_size=512"],
    "100m": ["model.arch.hidden_size=768", "model.arch.intermediate_size=2048", "model.arch.num_hidden_layers=12",
             "model.arch.num_attention_heads=12", "model.arch.num_key_value_heads=12",
             "model.tokenizer_vocab_size=16384"],
}
COMMON = ["data.seq_len=32", "data.max_documents=600", "train.max_steps=2", "train.global_batch_size=4",
          "train.micro_batch_size=2", "train.eval_every=100", "train.eval_batches=1", "train.sample_tokens=0",
          "train.checkpoint_every=100", "hardware.precision=fp32", "hardware.threads=1"]
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

# One rank runs as `single` (or as a one-rank shard for fsdp/zero3); ddp is for 2 and more.
# (strategy, ranks, optimizer offload): zero3's offload is planned and measured on its own;
# "fsdp:<layout>" pins parallel.layout; a plain "fsdp" leaves it to auto (one node: the fastest
# layout whose plan fits, gather_once on these sizes).
# `single` runs at both sizes: the plan's fixed runtime memory and its state are checked apart.
LAYOUTS = {"tiny": [("single", 1, False), ("fsdp", 1, False), ("zero3", 1, False)],
           "100m": [("single", 1, False), ("ddp", 2, False), ("fsdp:full_shard", 2, False), ("fsdp:gather_once", 2, False),
                    ("zero3", 2, False), ("zero3", 2, True)]}
CASES = [(s, st, n, off) for s in SIZES for st, n, off in LAYOUTS[s]]


@pytest.fixture(scope="module", autouse=True)
def timed_machine_cache(tmp_path_factory):
    """This file's own machine cache (the matmul peak each run's MFU is measured against), timed
    here once for the dtypes its runs train in (1 thread each), so that no run times it (~4 s of a
    child interpreter's matmuls, on both ranks of a 2-rank run) and every run reads it, whatever
    ran before. That a run which times the product itself (in a child: its rank's memory stays
    as it was) reaches the same step peak is checked once: the tiny `single` case starts from an
    empty cache (`cold_machine_cache`)."""
    import torch

    from cputrain.hardware import detect
    from cputrain.metrics.measured_peak import measured_peak_flops

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CPUTRAIN_CACHE_HOME", str(tmp_path_factory.mktemp("machine-cache")))
        hw = detect()
        for dtype in (torch.float32, torch.bfloat16):
            measured_peak_flops(hw.cpu_model, hw.flags, 1, dtype, apart=True)
        yield


@pytest.fixture
def cold_machine_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CPUTRAIN_CACHE_HOME", str(tmp_path / "machine-cache"))


def _train_and_compare(overrides: list[str], ranks: int, run_dir, timeout: int) -> tuple[list[dict], str]:
    """Train on `ranks` ranks, then each rank's plan-vs-measured row (stored bytes must be equal)."""
    launch = ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    # Peak RSS is compared with the plan: every rank starts as a user's would, a fresh interpreter
    # (not forked from the tests' warm ones); one rank is the command itself, more are started by
    # its agent, which is not measured and may be forked warm.
    proc = run_cli("train", *overrides, *launch, timeout=timeout, fresh=True if ranks == 1 else "ranks")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = compare_run(run_dir)
    assert len(rows) == ranks
    table = markdown_table(rows)
    for row in rows:
        for key in EXACT:
            assert row[f"plan_{key}"] == row[f"measured_{key}"], f"{key} differs\n{table}"
    return rows, table


@pytest.mark.slow
@pytest.mark.parametrize("size, strategy, ranks, offload", CASES,
                         ids=[f"{s}-{st.replace(':', '-')}-{n}{'-offload' if off else ''}" for s, st, n, off in CASES])
def test_plan_matches_memory_json(size, strategy, ranks, offload, tmp_path, cache_dir, request):
    if (size, strategy) == ("tiny", "single"):  # the run times its matmul peak itself, in a child
        request.getfixturevalue("cold_machine_cache")
    if strategy == "zero3" and not HAVE_DEEPSPEED:
        pytest.skip("strategy zero3 needs the deepspeed extra (scripts/install.sh dev,deepspeed)")
    strategy, _, layout = strategy.partition(":")
    overrides = SIZES[size] + COMMON + [f"parallel.strategy={strategy}", f"output_dir={tmp_path / 'run'}",
                                        f"data.cache_dir={cache_dir}", f"parallel.offload_optimizer={offload}"]
    if layout:
        overrides += [f"parallel.layout={layout}"]
    # Two micro-batches a step: gather_once accumulates every gradient unsharded between them; ddp
    # keeps them as views of its buckets, and its one rebuild of the buckets holds both copies.
    if layout == "gather_once" or strategy == "ddp":
        overrides += ["train.global_batch_size=8"]
    rows, table = _train_and_compare(overrides, ranks, tmp_path / "run", timeout=600)

    # `cputrain plan` on the same config, before any run, plans the same bytes (the vocabulary
    # of the tokenizer the run trained is given as the model's config, and the attention kernel
    # the run timed: eager keeps an attention matrix per block that sdpa does not).
    written = json.loads((tmp_path / "run" / "plan.json").read_text())
    vocab = written["model"]["vocab_size"]
    attention = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["attn_implementation"]
    proc = run_cli_here("plan", *overrides, f"model.tokenizer_vocab_size={vocab}",
                        f"model.attn_implementation={attention}", "--world-size", ranks, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ranks"] == written["ranks"]

    off = [r for r in rows if abs(r["rss_error"]) > RSS_TOLERANCE]
    assert not off, f"peak RSS off by {off[0]['rss_error']:+.1%}\n{table}"
    print(f"\n{table}")


# --- LoRA: a pretrained base (a Llama saved as a model folder), adapters on every projection --

# make_tiny_model's Llamas: MLP 2 × hidden, 4 heads, 2 key/value heads, its own 512-token BPE.
LORA_BASES = {"tiny": dict(hidden=64, layers=2), "64m": dict(hidden=768, layers=12)}
# (strategy, ranks, precision): bf16 is LoRA's case (the base frozen in bf16) and runs every layout
# at ~64M; fp32 keeps the base in fp32, checked once at the tiny size.
LORA_LAYOUTS = {"tiny": [("single", 1, "fp32")],
                "64m": [("single", 1, "bf16"), ("ddp", 2, "bf16"), ("fsdp", 2, "bf16")]}
LORA_CASES = [(s, st, n, prec) for s in LORA_BASES for st, n, prec in LORA_LAYOUTS[s]]


@pytest.fixture(scope="module")
def lora_base(tiny_model):
    return lambda size: tiny_model(**LORA_BASES[size])


@pytest.mark.slow
@pytest.mark.parametrize("size, strategy, ranks, precision", LORA_CASES,
                         ids=[f"lora-{s}-{st}-{n}-{prec}" for s, st, n, prec in LORA_CASES])
def test_lora_plan_matches_memory_json(size, strategy, ranks, precision, tmp_path, cache_dir, lora_base):
    overrides = [o for o in COMMON if not o.startswith("hardware.precision=")] + [
        f"model.name_or_path={lora_base(size)}", "model.lora.enabled=true", f"hardware.precision={precision}",
        "model.compile=false",  # inductor's compile is not in the plan (and takes minutes here)
        f"parallel.strategy={strategy}", f"output_dir={tmp_path / 'run'}", f"data.cache_dir={cache_dir}"]
    rows, table = _train_and_compare(overrides, ranks, tmp_path / "run", timeout=900)
    print(f"\n{table}")
    written = json.loads((tmp_path / "run" / "plan.json").read_text())
    trained = written["lora"]["trainable_parameters"]
    assert 0 < trained < written["model"]["parameters"] / (2 if size == "tiny" else 20)
    for row in rows:
        assert row["measured_grad_bytes"] <= -(-trained // ranks) * 4 * 2  # the adapters' gradients, nothing else

    # `cputrain plan` on the same config, before any run, adds the same adapters and plans the same bytes
    # (given the attention kernel the run timed).
    attention = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["attn_implementation"]
    proc = run_cli_here("plan", *overrides, f"model.attn_implementation={attention}", "--world-size", ranks, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ranks"] == written["ranks"]

    off = [r for r in rows if abs(r["rss_error"]) > RSS_TOLERANCE]
    assert not off, f"peak RSS off by {off[0]['rss_error']:+.1%}\n{table}"
