"""LoRA on this machine: what it saves against full fine-tuning, how it compares with peft under
the Hugging Face Trainer, how well `cputrain plan` predicts it, and what it does to a layer of
Llama-3-8B's shape. Writes block lora of docs/benchmarks/lora.md (one inner block per part, so a part
can be rerun alone with --only).

    python benchmarks/lora/lora.py            # every part; the Trainer needs `scripts/install.sh bench` (accelerate);
                                         # estimated 40 min on 2 cores, under 12 GiB: run it alone
    python benchmarks/lora/lora.py --quick    # tiny sizes, 3 steps, one run: checks the script only
    python benchmarks/lora/lora.py --only 300m|vs-peft|8b-layer|base-dtype|compile-timed|checkpointing

The base model: a ~300M-parameter Llama (1024 wide, 24 layers, ffn 2,816, 16 heads, 8 KV heads,
untied 8,192-token head) with random weights, saved once as a Hugging Face folder (bf16
safetensors, as released checkpoints are) with a byte-level BPE trained on the corpus
(tinyshakespeare, else builtin:pydoc). Every run reads that folder and that corpus, packed the
same way (documents joined with EOS, cut into 512-token blocks), and runs the same optimizer
steps of 4 × 2 micro-batches of 512 tokens, bf16 where the machine has AMX or AVX512-BF16.
LoRA everywhere is rank 16, alpha 32, no dropout, on all seven projections (q, k, v, o, gate,
up, down).

300m     `cputrain train` full fine-tuning vs `cputrain train model.lora.enabled=true` (each at
         its defaults otherwise), and the run's plan.json against its memory.json.
vs-peft  peft's `get_peft_model` + the HF Trainer (base loaded in bf16 like cputrain's frozen
         base, adapters fp32 as peft keeps them, `bf16=True`, `use_cpu=True`) vs cputrain LoRA.
8b-layer one and two LlamaDecoderLayers of Llama-3-8B's shape at seq_len 2,048, micro-batch 1,
         forward + backward + clip + fused AdamW under bf16 autocast: fp32 weights all trained,
         vs frozen bf16 weights with r=16 adapters injected by peft's `inject_adapter_in_model`.
base-dtype  LoRA in fp32 on the base saved in bf16: model.lora.base_dtype=bf16 (stored in bf16,
         converted per matmul) vs fp32 (the same values stored in fp32); speed, memory, losses.
compile-timed  LoRA with every decoder block compiled (model.compile=true) vs eager blocks
         (model.compile=false); speed, first step, memory.
checkpointing  LoRA at seq 2,048, micro-batch 1: every block checkpointed, selective (every block
         keeps its matmul outputs), half of the blocks, none (model.activation_checkpointing=true,
         selective, N, false); speed, step peak against the plan.

Each run is a fresh process; the configurations alternate within each of --runs repetitions and
medians are reported. Tokens/s is the median of the per-step rates after the first --warmup
steps (compile, allocation). Peak RSS is measured the same way on every side: the kernel's
high-water mark (VmHWM) reset before each training step and read after it, the highest over the
steps (cputrain's memory.json "training step peak"; a Trainer callback doing the same). The
whole process's peak (ru_maxrss, loading and saving included) is shown beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.base_model import make_base  # noqa: E402
from benchmarks.runner.hf_trainer_clock import trainer_step_clock  # noqa: E402
from benchmarks.runner.machine import physical_cores  # noqa: E402
from benchmarks.runner.processes import run_child, run_measured, run_measured_child  # noqa: E402
from benchmarks.runner.timing import steady_median, time_steps  # noqa: E402
from benchmarks.step_time.layer_mfu import layers_step  # noqa: E402
from benchmarks.vs_hf_trainer.vs_hf_trainer import RowsDataset, corpus_documents, packed_rows  # noqa: E402

ARCH_300M = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 8, "max_position_embeddings": 2048, "tie_word_embeddings": False}
QUICK_ARCH = {**ARCH_300M, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
LLAMA3_8B_LAYER = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "rope_theta": 500000.0, "vocab_size": 128256,
                   "max_position_embeddings": 8192}
QUICK_LAYER = {**LLAMA3_8B_LAYER, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 8192}
SEQ_LEN, LAYER_SEQ_LEN = 512, 2048
MICRO, ACCUM = 4, 2
RANK, ALPHA = 16, 32.0
LR, WARMUP_LR, SEED = 1e-4, 2, 1337
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARTS = ("300m", "vs-peft", "8b-layer", "base-dtype", "compile-timed", "checkpointing")


# `--set KEY=VALUE` overrides appended to every run (a variant printed, never written to the doc)
EXTRA_OVERRIDES: list[str] = []


def run_cputrain(base: str, lora: bool, steps: int, warmup: int, seq_len: int, source: str, cache_dir: str,
                 precision: str, extra: tuple[str, ...] = ()) -> dict:
    overrides = [f"model.name_or_path={base}", f"data.cache_dir={cache_dir}", f"data.source={source}",
                 f"data.seq_len={seq_len}", f"train.max_steps={steps}", f"train.global_batch_size={MICRO * ACCUM}",
                 f"train.micro_batch_size={MICRO}", f"train.lr={LR}", f"train.warmup_steps={WARMUP_LR}",
                 "train.log_every=1", f"train.eval_every={steps}", "train.eval_batches=1",
                 f"train.checkpoint_every={steps}", "train.sample_tokens=0", f"hardware.precision={precision}",
                 f"seed={SEED}"]
    if lora:
        overrides += ["model.lora.enabled=true", f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}",
                      "model.lora.dropout=0.0", f"model.lora.target_modules=[{','.join(TARGETS)}]"]
    return train_and_read([*overrides, *extra, *EXTRA_OVERRIDES], warmup, "LoRA" if lora else "full")


def train_and_read(overrides: list[str], warmup: int, what: str) -> dict:
    """`cputrain train <overrides>` in a fresh process and a temporary output folder; what its
    metrics.jsonl, memory.json, summary.json and plan.json say."""
    from cputrain.plan.memory.compare import compare_run

    with tempfile.TemporaryDirectory(prefix="cputrain-lora-bench-") as out:
        run = Path(out) / "run"
        cmd = [sys.executable, "-m", "cputrain", "train", f"output_dir={run}", *overrides]
        _, stderr, code, process_peak = run_measured(cmd)
        if code:
            raise RuntimeError(f"cputrain ({what}) failed:\n{stderr[-3000:]}")
        summary = json.loads((run / "summary.json").read_text())
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
        plan = compare_run(run)[0]
        exact = all(plan[f"plan_{k}"] == plan[f"measured_{k}"]
                    for k in ("param_bytes", "grad_bytes", "optimizer_bytes"))
        memory = json.loads((run / "memory.json").read_text())
    step_peak = next(p for p in memory["ranks"][0]["phases"] if p["phase"] == "training step peak")
    first_step_s = next((r["step_time_s"] for r in rows if "step_time_s" in r), float("nan"))
    return {"tokens_per_s": steady_median(rates, warmup), "step_peak_rss_gib": step_peak["rss_gib"],
            "first_step_s": first_step_s,
            "losses": [r["loss"] for r in rows if "loss" in r and "tokens_per_s" in r],
            "process_peak_rss_gib": process_peak, "parameters": summary["parameters"],
            "trained_parameters": summary["trained_parameters"], "mfu": summary["mfu"],
            "attn_implementation": summary.get("attn_implementation"), "compile": summary.get("compile"),
            "precision": summary.get("precision"),
            "plan_peak_rss_gib": plan["plan_peak_rss_gib"], "plan_measured_peak_rss_gib": plan["measured_peak_rss_gib"],
            "plan_error": plan["rss_error"], "plan_bytes_exact": exact, "wall_s": summary["wall_time_s"]}


# ------------------------------------------------------------------------------------------
# peft + the HF Trainer (in its own process; prints one JSON line).


def peft_child(opts: dict) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments,
                              default_data_collator)

    torch.set_num_threads(physical_cores())  # the threads cputrain's `auto` gives one rank
    base, seq_len = opts["base"], opts["seq_len"]
    tok = AutoTokenizer.from_pretrained(base)
    docs = corpus_documents(opts["source"])
    rows = RowsDataset(packed_rows(tok, docs, seq_len))

    clock = trainer_step_clock()  # the same step peak cputrain's memory.json reads
    marks, peaks = clock.marks, clock.peaks

    dtype = getattr(torch, opts["base_dtype"])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, attn_implementation="sdpa")
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS), bias="none",
                        task_type="CAUSAL_LM")
    model = get_peft_model(model, config)  # adapters in fp32 (autocast_adapter_dtype), base frozen
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=opts["steps"], per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=ACCUM, learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=WARMUP_LR,
            weight_decay=0.0, max_grad_norm=1.0, seed=SEED, use_cpu=True, bf16=opts["bf16"], report_to="none",
            save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator,
                          callbacks=[clock])
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    tokens_per_step = MICRO * ACCUM * seq_len  # packed: every token is a useful one
    times = [b - a for a, b in zip([t0] + marks[:-1], marks)]
    rates = [tokens_per_step / t for t in times]
    return {"tokens_per_s": steady_median(rates, opts["warmup"]), "step_peak_rss_gib": max(peaks),
            "trained_parameters": trained, "wall_s": wall, "steps": len(marks)}


def run_peft(base: str, steps: int, warmup: int, seq_len: int, source: str, bf16: bool, base_dtype: str) -> dict:
    opts = {"base": base, "steps": steps, "warmup": warmup, "seq_len": seq_len, "source": source, "bf16": bf16,
            "base_dtype": base_dtype}
    return run_measured_child("peft + Trainer", __file__, "peft", json.dumps(opts))[0]


# ------------------------------------------------------------------------------------------
# Llama-3-8B-shaped decoder layers: all weights trained, or frozen bf16 + adapters.


def layers_child(opts: dict) -> dict:
    import torch
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import LoraLayer
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from cputrain.kernels.attention_choice import attention_choice
    from cputrain.metrics import memory

    torch.set_num_threads(physical_cores())
    cfg = LlamaConfig(**{**opts["shape"], "num_hidden_layers": opts["layers"]})
    choice = attention_choice(cfg, 1, opts["seq_len"], torch.bfloat16)
    cfg._attn_implementation = choice.implementation
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(opts["layers"])])
    if opts["lora"]:
        inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS),
                                           bias="none"), holder)
        # what cputrain does to a LoRA model under bf16: the frozen base stored in bf16, the
        # adapters kept fp32, no cast of each layer's input to the adapters' dtype
        for p in holder.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
        for m in holder.modules():
            if isinstance(m, LoraLayer):
                m.cast_input_dtype_enabled = False
    rotary = LlamaRotaryEmbedding(cfg)
    params = [p for p in holder.parameters() if p.requires_grad]
    step = layers_step(holder.layers, rotary, params, opts["seq_len"], cfg.hidden_size)

    before_steps = memory.rss_gib()
    memory.reset_peak()  # the steps' peak: weights, gradients, optimizer state, activations
    timing = time_steps(step, opts["steps"])
    return {**timing, "step_peak_rss_gib": memory.peak_rss_gib(), "rss_before_steps_gib": before_steps,
            "trained_parameters": sum(p.numel() for p in params),
            "parameters": sum(p.numel() for p in holder.parameters()), "attn": choice.implementation}


# ------------------------------------------------------------------------------------------


def spread(values: list[float], fmt: str = ",.0f") -> str:
    return f"{min(values):{fmt}}–{max(values):{fmt}}" if len(values) > 1 else "one run"


def med(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def write_doc(blocks: dict[str, str], docs: Path | None = None) -> None:
    """Block `lora` holds one inner block per part; a part run alone replaces only its own."""
    from benchmarks.runner.pages import DOCS, page_of
    from benchmarks.runner.blocks import write_block

    docs = docs or DOCS
    page = page_of("lora", docs)
    text = page.read_text() if page.exists() else ""
    if "<!-- bench: lora -->" not in text:
        inner = "\n\n".join(f"<!-- bench: lora_{p} -->\n(not measured yet: `python benchmarks/lora/lora.py --only {p}`)\n"
                            f"<!-- /bench: lora_{p} -->" for p in PARTS)
        write_block("lora", inner, docs)
    for part, markdown in blocks.items():
        write_block(f"lora_{part}", markdown, docs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, 3 steps, one run, print only")
    ap.add_argument("--only", choices=PARTS, default=None, help="run one part (and write only its inner block)")
    ap.add_argument("--runs", type=int, default=3, help="fresh-process runs per configuration (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per 300M run (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s (default: %(default)s)")
    ap.add_argument("--layer-steps", type=int, default=3, help="timed steps per 8B-layer run, after 2 untimed "
                    "(default: %(default)s)")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="auto: bf16 where the machine has AMX or AVX512-BF16, else fp32")
    ap.add_argument("--peft-base-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="dtype the Trainer side loads the frozen base in (default: %(default)s, as cputrain "
                    "stores it)")
    ap.add_argument("--source", default=None, help="corpus (default: ../shared/data/tinyshakespeare.txt if present, "
                    "else builtin:pydoc)")
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench"), help="tokenizer/data cache")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run (e.g. hardware.allocator=system); prints, writes no doc")
    a = ap.parse_args()
    EXTRA_OVERRIDES.extend(a.set)
    if a.child:
        kind, opts = a.child[0], json.loads(a.child[1])
        print(json.dumps(peft_child(opts) if kind == "peft" else layers_child(opts)))
        return

    from benchmarks.runner.machine import machine_line
    from cputrain.hardware import detect

    hw = detect()
    precision = a.precision if a.precision != "auto" else (
        "bf16" if hw.flags.get("amx_bf16") or hw.flags.get("avx512_bf16") else "fp32")
    bf16 = precision == "bf16"
    runs = 1 if a.quick else a.runs
    steps = 3 if a.quick else a.steps
    warmup = 1 if a.quick else a.warmup
    arch, seq_len = (QUICK_ARCH, 64) if a.quick else (ARCH_300M, SEQ_LEN)
    parts = [a.only] if a.only else list(PARTS)
    shakespeare = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
    source = a.source or (str(shakespeare) if shakespeare.is_file() else "builtin:pydoc")
    corpus = Path(source).name if not source.startswith("builtin:") else source
    cores = physical_cores()
    blocks: dict[str, str] = {}
    t_start = time.perf_counter()

    if "300m" in parts or "vs-peft" in parts:
        with tempfile.TemporaryDirectory(prefix="cputrain-lora-base-") as tmp:
            base = str(Path(tmp) / "base")
            shape = make_base(Path(base), arch, source, a.cache_dir, "bfloat16" if bf16 else "float32")
            print(f"base model: {shape['parameters'] / 1e6:.1f}M parameters in {base}", file=sys.stderr)
            sides = (["full"] if "300m" in parts else []) + ["lora"] + (["peft"] if "vs-peft" in parts else [])
            results: dict[str, list[dict]] = {s: [] for s in sides}
            for rep in range(runs):  # alternated, so a slow spell of the machine hits every side
                for side in sides:
                    if side == "peft":
                        r = run_peft(base, steps, warmup, seq_len, source, bf16, a.peft_base_dtype)
                    else:
                        r = run_cputrain(base, side == "lora", steps, warmup, seq_len, source, a.cache_dir, precision)
                    results[side].append(r)
                    print(f"run {rep + 1}/{runs} {side}: {r['tokens_per_s']:,.0f} tokens/s, step peak "
                          f"{r['step_peak_rss_gib']:.2f} GiB, process peak {r['process_peak_rss_gib']:.2f} GiB",
                          file=sys.stderr)
        tps = {s: med(v, "tokens_per_s") for s, v in results.items()}
        peak = {s: med(v, "step_peak_rss_gib") for s, v in results.items()}
        proc_peak = {s: med(v, "process_peak_rss_gib") for s, v in results.items()}
        lora = results["lora"]
        last = lora[-1]
        model_line = (f"Base: Llama {arch['hidden_size']} wide, {arch['num_hidden_layers']} layers, ffn "
                      f"{arch['intermediate_size']:,}, {arch['num_attention_heads']} heads / "
                      f"{arch['num_key_value_heads']} KV heads, untied {shape['vocab']:,}-token head: "
                      f"{shape['parameters'] / 1e6:.1f}M parameters, random weights in a Hugging Face folder "
                      f"({'bf16' if bf16 else 'fp32'} safetensors). {steps} optimizer steps of {MICRO} × {ACCUM} "
                      f"micro-batches × {seq_len} tokens of `{corpus}` (run_clm packing), {precision}, "
                      f"{cores} threads; "
                      f"LoRA r={RANK}, alpha {ALPHA:g}, on {', '.join(TARGETS)}. Tokens/s: median per-step rate after "
                      f"the first {warmup} step(s); step peak: VmHWM reset before each step, highest over the steps; "
                      f"process peak: the process's ru_maxrss (loading, evaluation and saving included). Median of "
                      f"{runs} fresh-process run(s), the sides alternated.")

        def row(name: str, side: str, ref: str | None = None) -> str:
            rs = results[side]
            vs = f"{tps[side] / tps[ref]:.2f}×" if ref else ""
            return (f"| {name} | {rs[-1]['trained_parameters'] / 1e6:,.2f}M | {tps[side]:,.0f} | "
                    f"{spread([r['tokens_per_s'] for r in rs])} | {peak[side]:.2f} | {proc_peak[side]:.2f} | {vs} |")

        header = ("| run | trained parameters | tokens/s | range | step peak RSS (GiB) | process peak RSS (GiB) | "
                  "tokens/s vs cputrain LoRA |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        if "300m" in parts:
            ratio = peak["lora"] / peak["full"]
            errors = [r["plan_error"] for r in lora]
            plan_err = statistics.median(errors)
            blocks["300m"] = f"""### LoRA vs full fine-tuning in cputrain, ~300M Llama

{machine_line()}

`python benchmarks/lora/lora.py --only 300m`. {model_line} cputrain at its defaults otherwise (attention
{last['attn_implementation']}, compile {last['compile']}).

{header}
{row('`cputrain train` full fine-tuning (fp32 masters, AdamW)', 'full', 'lora')}
{row('`cputrain train model.lora.enabled=true` (frozen base in ' + ('bf16' if bf16 else 'fp32') + ')', 'lora', 'lora')}

| measure | value | target |
| --- | ---: | --- |
| step peak RSS, LoRA ÷ full | {ratio:.2f} ({peak['lora']:.2f} / {peak['full']:.2f} GiB) | ≤ 0.45: {'met' if ratio <= 0.45 else 'not met'} |
| process peak RSS, LoRA ÷ full | {proc_peak['lora'] / proc_peak['full']:.2f} | |
| tokens/s, LoRA ÷ full | {tps['lora'] / tps['full']:.2f}× | |
| `cputrain plan` training peak of the LoRA run vs its memory.json | {med(lora, 'plan_peak_rss_gib'):.2f} / {med(lora, 'plan_measured_peak_rss_gib'):.2f} GiB, error {plan_err:+.1%} (runs: {', '.join(f'{e:+.1%}' for e in errors)}) | ±15%: {'met' if abs(plan_err) <= 0.15 else 'not met'} |
| its parameter, gradient and optimizer bytes, plan vs measured | {'equal' if all(r['plan_bytes_exact'] for r in lora) else 'DIFFER'} | equal |
"""
        if "vs-peft" in parts:
            ratio = tps["lora"] / tps["peft"]
            blocks["vs-peft"] = f"""### cputrain LoRA vs peft + the Hugging Face Trainer, ~300M Llama

{machine_line()}

`python benchmarks/lora/lora.py --only vs-peft`. {model_line} The Trainer side: `get_peft_model` with the same
LoraConfig on the base loaded with `dtype={a.peft_base_dtype}` (adapters fp32, as peft keeps them),
TrainingArguments `bf16={bf16}`, `use_cpu=True`, micro-batch {MICRO}, accumulation {ACCUM}, SDPA attention; its step peak
is read by a callback around each optimizer step, the same way cputrain reads its own.

{header}
{row('peft `get_peft_model` + HF Trainer', 'peft', 'lora')}
{row('`cputrain train model.lora.enabled=true`', 'lora', 'lora')}

Targets: cputrain LoRA ≥ 1.2× the Trainer's tokens/s: {'met' if ratio >= 1.2 else 'not met'} ({ratio:.2f}×); step peak
RSS cputrain ÷ Trainer: {peak['lora'] / peak['peft']:.2f} ({peak['lora']:.2f} / {peak['peft']:.2f} GiB).
"""

    if "base-dtype" in parts:
        # model.lora.base_dtype under fp32 compute, on bf16 files: the frozen base stored in bf16
        # (each matrix converted for its matmul) against the same values stored in fp32
        with tempfile.TemporaryDirectory(prefix="cputrain-lora-base-") as tmp:
            base = str(Path(tmp) / "base")
            shape = make_base(Path(base), arch, source, a.cache_dir, "bfloat16")
            sides = ("bf16", "fp32")
            results = {s: [] for s in sides}
            for rep in range(runs):
                for side in sides:
                    r = run_cputrain(base, True, steps, warmup, seq_len, source, a.cache_dir, "fp32",
                                     extra=(f"model.lora.base_dtype={side}",))
                    results[side].append(r)
                    print(f"run {rep + 1}/{runs} base {side}: {r['tokens_per_s']:,.0f} tokens/s, step peak "
                          f"{r['step_peak_rss_gib']:.2f} GiB, losses {r['losses']}", file=sys.stderr)
        tps = {s: med(v, "tokens_per_s") for s, v in results.items()}
        peak = {s: med(v, "step_peak_rss_gib") for s, v in results.items()}
        loss_diff = max(abs(x - y) for r16, r32 in zip(results["bf16"], results["fp32"])
                        for x, y in zip(r16["losses"], r32["losses"]))
        rows = "\n".join(
            f"| `model.lora.base_dtype={s}` | {tps[s]:,.0f} | {spread([r['tokens_per_s'] for r in results[s]])} | "
            f"{peak[s]:.2f} | {med(results[s], 'process_peak_rss_gib'):.2f} | {med(results[s], 'plan_peak_rss_gib'):.2f} "
            f"({statistics.median(r['plan_error'] for r in results[s]):+.1%}) | {tps[s] / tps['fp32']:.2f}× |"
            for s in sides)
        blocks["base-dtype"] = f"""### A bf16-stored LoRA base under fp32 compute, ~300M Llama

{machine_line()}

`python benchmarks/lora/lora.py --only base-dtype --steps {steps} --runs {runs}`: the ~300M base above
({shape['parameters'] / 1e6:.1f}M parameters) saved in bf16, LoRA r={RANK} on the seven projections, `hardware.precision=fp32`,
{steps} optimizer steps of {MICRO} × {ACCUM} micro-batches × {seq_len} tokens, the two sides alternated, median of {runs}
fresh-process run(s). bf16: the frozen matrices stored in bf16, each converted to fp32 for its matmul
(cputrain.kernels.upcast_linear); fp32: the same bf16 values stored in fp32.

| run | tokens/s | range | step peak RSS (GiB) | process peak RSS (GiB) | plan peak (error) | tokens/s vs fp32-stored |
| --- | ---: | ---: | ---: | ---: | ---: | ---: |
{rows}

Losses of every step, bf16-stored vs fp32-stored: largest difference {loss_diff:.1e} (target ≤ 1e-5:
{'met' if loss_diff <= 1e-5 else 'not met'}). Step peak RSS bf16 ÷ fp32: {peak['bf16'] / peak['fp32']:.2f}.
"""

    if "compile-timed" in parts:
        # model.compile for LoRA: `auto` leaves the blocks eager; this measures what compiling them does
        with tempfile.TemporaryDirectory(prefix="cputrain-lora-base-") as tmp:
            base = str(Path(tmp) / "base")
            shape = make_base(Path(base), arch, source, a.cache_dir, "bfloat16" if bf16 else "float32")
            sides = ("eager", "compiled")
            results = {s: [] for s in sides}
            for rep in range(runs):
                for side in sides:
                    r = run_cputrain(base, True, steps, warmup, seq_len, source, a.cache_dir, precision,
                                     extra=(f"model.compile={side == 'compiled'}",))
                    results[side].append(r)
                    print(f"run {rep + 1}/{runs} LoRA {side}: {r['tokens_per_s']:,.0f} tokens/s, step peak "
                          f"{r['step_peak_rss_gib']:.2f} GiB, first step {r['first_step_s']:.1f} s", file=sys.stderr)
        tps = {s: med(v, "tokens_per_s") for s, v in results.items()}
        rows = "\n".join(
            f"| {'`model.compile=true`: every decoder block compiled' if s == 'compiled' else '`model.compile=false`: eager blocks'} | "
            f"{tps[s]:,.0f} | {spread([r['tokens_per_s'] for r in results[s]])} | {med(results[s], 'first_step_s'):.1f} | "
            f"{med(results[s], 'step_peak_rss_gib'):.2f} | {tps[s] / tps['eager']:.2f}× |" for s in sides)
        blocks["compile-timed"] = f"""### Compiled blocks with LoRA, timed, ~300M Llama

{machine_line()}

`python benchmarks/lora/lora.py --only compile-timed --steps {steps} --runs {runs}`: the ~300M base above
({shape['parameters'] / 1e6:.1f}M parameters, {'bf16' if bf16 else 'fp32'} safetensors), LoRA r={RANK} on the seven projections,
{precision}, {steps} optimizer steps of {MICRO} × {ACCUM} micro-batches × {seq_len} tokens, tokens/s after the first
{warmup} step(s) (the first step compiles), the two sides alternated, median of {runs} fresh-process run(s).

| run | tokens/s | range | first step (s) | step peak RSS (GiB) | tokens/s vs eager |
| --- | ---: | ---: | ---: | ---: | ---: |
{rows}
"""

    if "checkpointing" in parts:
        # model.activation_checkpointing: what each block recomputed costs, and what keeping it costs in memory
        ck_seq = 128 if a.quick else LAYER_SEQ_LEN
        half = arch["num_hidden_layers"] // 2
        # in order of recompute, most first; selective recomputes no matmul, only norms, RoPE and SiLU × up
        sides = {"every block (true)": "true", "selective": "selective",
                 f"the first {half} blocks ({half})": str(half), "none (false)": "false"}
        with tempfile.TemporaryDirectory(prefix="cputrain-lora-base-") as tmp:
            base = str(Path(tmp) / "base")
            shape = make_base(Path(base), arch, source, a.cache_dir, "bfloat16" if bf16 else "float32")
            results = {s: [] for s in sides}
            for rep in range(runs):
                for side, setting in sides.items():
                    r = run_cputrain(base, True, steps, warmup, ck_seq, source, a.cache_dir, precision,
                                     extra=(f"model.activation_checkpointing={setting}", "train.micro_batch_size=1",
                                            "train.global_batch_size=2", "model.compile=false"))
                    results[side].append(r)
                    print(f"run {rep + 1}/{runs} LoRA checkpointing {side}: {r['tokens_per_s']:,.0f} tokens/s, step "
                          f"peak {r['step_peak_rss_gib']:.2f} GiB (plan {r['plan_peak_rss_gib']:.2f})", file=sys.stderr)
        tps = {s: med(v, "tokens_per_s") for s, v in results.items()}
        every = next(iter(sides))
        rows = "\n".join(
            f"| {s} | {tps[s]:,.0f} | {spread([r['tokens_per_s'] for r in results[s]])} | "
            f"{med(results[s], 'step_peak_rss_gib'):.2f} | {med(results[s], 'plan_peak_rss_gib'):.2f} "
            f"({statistics.median(r['plan_error'] for r in results[s]):+.1%}) | {tps[s] / tps[every]:.2f}× |"
            for s in sides)
        blocks["checkpointing"] = f"""### Activation checkpointing with LoRA: recompute against memory, ~300M Llama

{machine_line()}

`python benchmarks/lora/lora.py --only checkpointing --steps {steps} --runs {runs}`: the ~300M base above
({shape['parameters'] / 1e6:.1f}M parameters, {arch['num_hidden_layers']} blocks), LoRA r={RANK} on the seven projections, {precision},
{steps} optimizer steps of 2 micro-batches × 1 × {ck_seq} tokens, eager blocks, tokens/s after the first {warmup} step(s), the sides
alternated, median of {runs} fresh-process run(s). `selective` keeps every block's matmul and attention outputs and
recomputes the rest (cputrain.model.selective_checkpointing). `model.activation_checkpointing=auto` picks among these
by the plan and the node's memory (cputrain.plan.memory.checkpointing): none, else selective, else the fewest blocks.

| checkpointing | tokens/s | range | step peak RSS (GiB) | plan peak (error) | tokens/s vs every block |
| --- | ---: | ---: | ---: | ---: | ---: |
{rows}
"""

    if "8b-layer" in parts:
        layer_shape, layer_seq = (QUICK_LAYER, 128) if a.quick else (LLAMA3_8B_LAYER, LAYER_SEQ_LEN)
        layer_steps = 1 if a.quick else a.layer_steps
        configs = [(lora, n) for lora in (False, True) for n in (1, 2)]
        layer_runs: dict[tuple[bool, int], list[dict]] = {c: [] for c in configs}
        for rep in range(runs):
            for lora, n in configs:
                r = run_child(__file__, "layers", json.dumps({"shape": layer_shape, "layers": n, "seq_len": layer_seq,
                                                              "steps": layer_steps, "lora": lora}))
                layer_runs[(lora, n)].append(r)
                print(f"run {rep + 1}/{runs} {'LoRA' if lora else 'full'} × {n} layer(s): {r['step_s']:.2f} s, "
                      f"step peak {r['step_peak_rss_gib']:.2f} GiB", file=sys.stderr)
        step_s = {c: med(v, "step_s") for c, v in layer_runs.items()}
        lpeak = {c: med(v, "step_peak_rss_gib") for c, v in layer_runs.items()}
        per_layer_s = {lora: step_s[(lora, 2)] / 2 for lora in (False, True)}
        per_layer_gib = {lora: lpeak[(lora, 2)] - lpeak[(lora, 1)] for lora in (False, True)}
        rows = []
        for lora, n in configs:
            rs = layer_runs[(lora, n)]
            rows.append(f"| {'frozen bf16 + r=' + str(RANK) + ' adapters' if lora else 'full (fp32 weights, AdamW)'} | "
                        f"{n} | {rs[0]['trained_parameters'] / n / 1e6:,.2f}M | {step_s[(lora, n)]:.2f} | "
                        f"{step_s[(lora, n)] / n:.2f} | {spread([r['step_s'] for r in rs], '.2f')} | "
                        f"{lpeak[(lora, n)]:.2f} | {med(rs, 'first_step_s'):.1f} |")
        attn = layer_runs[(False, 1)][0]["attn"]
        blocks["8b-layer"] = f"""### LoRA on decoder layers of Llama-3-8B's shape

{machine_line()}

`python benchmarks/lora/lora.py --only 8b-layer`: LlamaDecoderLayers of d={layer_shape['hidden_size']}, ffn
{layer_shape['intermediate_size']:,}, {layer_shape['num_attention_heads']} heads / {layer_shape['num_key_value_heads']} KV heads
at seq_len {layer_seq}, micro-batch 1, forward + backward + clip + fused AdamW under bf16 autocast, {cores} threads,
attention {attn}; median of {layer_steps} steps after 2, median of {runs} fresh process(es). Full: fp32 weights, all
trained. LoRA: peft's `inject_adapter_in_model` (r={RANK}, alpha {ALPHA:g}, the seven projections), base weights frozen
and stored in bf16, adapters fp32. Step peak: VmHWM reset before the steps, read after.

| weights | layers | trained parameters a layer | step (s) | per layer (s) | range (s) | step peak RSS (GiB) | first step (s) |
| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}

Per layer (two layers' step ÷ 2; memory: two layers' peak − one layer's): full {per_layer_s[False]:.2f} s and
{per_layer_gib[False]:.2f} GiB, LoRA {per_layer_s[True]:.2f} s and {per_layer_gib[True]:.2f} GiB. LoRA ÷ full:
time {per_layer_s[True] / per_layer_s[False]:.2f}×, memory {per_layer_gib[True] / per_layer_gib[False]:.2f}×.
"""

    for part in PARTS:
        if part in blocks:
            print(blocks[part])
    print(f"wall time {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    if not a.quick and not a.set:
        write_doc(blocks)
        print("written to docs/benchmarks/lora.md", file=sys.stderr)


if __name__ == "__main__":
    main()
