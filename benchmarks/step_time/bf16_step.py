"""The bf16 training step on this machine: what each change buys, and cputrain against the
Hugging Face Trainer (packed data, bf16) side by side. Writes block bf16_step of docs/benchmarks/step-time.md.

    python benchmarks/step_time/bf16_step.py            # the figures (needs `scripts/install.sh bench`)
    python benchmarks/step_time/bf16_step.py --quick    # a tiny model, one repetition: checks the script only

Part 1, the changes one at a time, cumulative: the step cputrain runs (micro-batches of forward
with labels, backward, clip, AdamW) on a ~97M Llama (768 wide, 12 layers, 8,192-token vocabulary,
seq_len 512, micro-batch 4, 2 micro-batches a step), random tokens, each variant in a fresh
process, interleaved over repetitions; tokens/s from the median timed step. A variant that was
tried and not kept is measured beside them.
Part 2, end to end on the same corpus and tokenizer: `cputrain train` (bf16, every setting at
its default) and the HF Trainer on run_clm-packed blocks with bf16=True, same model, batch and
steps; tokens/s at steady state (after the first step), median over fresh processes.
Where the machine has neither AMX nor AVX512-BF16, bf16 is emulated: run with --precision fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.processes import run_child  # noqa: E402
from benchmarks.runner.timing import time_steps  # noqa: E402
from benchmarks.runner.base_model import shared_tokenizer  # noqa: E402
from benchmarks.runner.machine import physical_cores  # noqa: E402
from benchmarks.vs_hf_trainer.vs_hf_trainer import (SEQ_LEN, in_fresh_process as hf_in_fresh_process,  # noqa: E402
                                                    run_cputrain)

VOCAB = 8192
MICRO, ACCUM = 4, 2
ARCH = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
        "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 1024,
        "tie_word_embeddings": False}
QUICK_ARCH = {**ARCH, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4}

# Cumulative: each row adds one change to the row above. "autocast" is bf16 autocast around each
# micro-batch's forward with fp32 master weights (what cputrain did before these changes).
STEPS = {
    "before: autocast per micro-batch, foreach AdamW, plain head, SDPA": {},
    "+ fused AdamW": {"fused": True},
    "+ chunked head + cross-entropy": {"fused": True, "chunked": True},
    "+ attention kernel timed on the shape (auto)": {"fused": True, "chunked": True, "attn": "auto"},
    "+ compiled decoder blocks": {"fused": True, "chunked": True, "attn": "auto", "compile": True},
    "+ one autocast around all micro-batches: bf16 weight copies once per step (= cputrain's bf16 default)":
        {"fused": True, "chunked": True, "attn": "auto", "compile": True, "autocast_per_step": True},
}
NOT_KEPT = {
    "tried: bf16 model weights, no autocast (no fp32 masters: a bound, not a recipe)":
        {"fused": True, "chunked": True, "attn": "auto", "compile": True, "pure_bf16": True},
}


def step_child(opts: dict) -> dict:
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from cputrain.kernels.attention_choice import attention_choice
    from cputrain.kernels.chunked_head import install_chunked_loss
    from cputrain.model import compile_blocks

    torch.set_num_threads(physical_cores())
    arch = dict(opts["arch"])
    config = CONFIG_MAPPING[arch.pop("model_type")](**arch, vocab_size=VOCAB)
    dtype = torch.bfloat16 if opts["precision"] == "bf16" else torch.float32
    attn, why = opts.get("attn", "sdpa"), ""
    if attn == "auto":
        choice = attention_choice(config, MICRO, opts["seq_len"], dtype)
        attn, why = choice.implementation, choice.reason
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    if opts.get("pure_bf16"):
        model.to(torch.bfloat16)
    if opts.get("chunked"):
        install_chunked_loss(model)
    if opts.get("compile"):
        compile_blocks(model, str(REPO / ".cache" / "bench" / "inductor"))
    fused = bool(opts.get("fused"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=not fused)
    batches = [torch.randint(0, VOCAB, (MICRO, opts["seq_len"])) for _ in range(ACCUM)]
    use_autocast = dtype == torch.bfloat16 and not opts.get("pure_bf16")

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16) if use_autocast else contextlib.nullcontext()

    def step():
        outer = autocast() if opts.get("autocast_per_step") else contextlib.nullcontext()
        with outer:
            for tokens in batches:
                inner = contextlib.nullcontext() if opts.get("autocast_per_step") else autocast()
                with inner:
                    loss = model(input_ids=tokens, labels=tokens).loss / ACCUM
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {**time_steps(step, opts["steps"]), "attn": attn, "attn_why": why}


def fresh(opts: dict) -> dict:
    return run_child(__file__, json.dumps(opts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per run of part 2")
    ap.add_argument("--step-repeats", type=int, default=2, help="fresh processes per variant of part 1")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant of part 1")
    ap.add_argument("--train-steps", type=int, default=16, help="optimizer steps per run of part 2")
    ap.add_argument("--only", choices=["steps", "end-to-end"], default=None)
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(step_child(json.loads(a.child))))
        return
    arch, seq_len = (QUICK_ARCH, 64) if a.quick else (ARCH, SEQ_LEN)
    repeats = 1 if a.quick else a.repeats
    tokens_per_step = MICRO * ACCUM * seq_len
    from benchmarks.runner.blocks import write_block
    from benchmarks.runner.machine import machine_line

    blocks = {}  # docs block name → markdown; each part owns its block, so either can be rerun alone
    if a.only in (None, "steps"):
        variants = {**STEPS, **NOT_KEPT}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for _ in range(1 if a.quick else a.step_repeats):  # interleaved: a slow spell hits every variant
            for name, v in variants.items():
                runs[name].append(fresh({"arch": arch, "seq_len": seq_len, "steps": 1 if a.quick else a.steps,
                                         "precision": a.precision, **v}))
                print(name, runs[name][-1], file=sys.stderr)
        base = statistics.median(r["step_s"] for r in runs[next(iter(STEPS))])
        rows = []
        for name, rs in runs.items():
            step_s = statistics.median(r["step_s"] for r in rs)
            rows.append(f"| {name} | {step_s:.2f} | {tokens_per_step / step_s:,.0f} | {base / step_s:.2f}× | "
                        f"{statistics.median(r['first_step_s'] for r in rs):.1f} |")
        why = next((r["attn_why"] for r in runs[list(STEPS)[3]] if r["attn_why"]), "")
        blocks["bf16_step"] = (f"""### The bf16 training step: what each change buys

{machine_line()}

`python benchmarks/step_time/bf16_step.py --only steps`: Llama {arch['hidden_size']} wide, {arch['num_hidden_layers']} layers,
{VOCAB}-token vocabulary, seq_len {seq_len}, micro-batch {MICRO} × {ACCUM} micro-batches a step, {a.precision},
{physical_cores()} threads; median of {a.steps} timed steps after 2, median over {1 if a.quick else a.step_repeats} fresh process(es).

| step (cumulative) | step (s) | tokens/s | vs before | first step (s) |
| --- | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}

Attention choice in the auto row: {why or 'n/a'}.
""")
    if a.only in (None, "end-to-end"):
        shakespeare = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
        source = str(shakespeare) if shakespeare.is_file() else "builtin:pydoc"
        shared_tokenizer(source, a.cache_dir, VOCAB)
        steps = 4 if a.quick else a.train_steps
        bf16 = a.precision == "bf16"
        before = ("model.chunked_loss=false", "model.attn_implementation=sdpa", "model.compile=false")
        results: dict[str, list[dict]] = {"hf": [], "cputrain": [], "cputrain-before": []}
        for _ in range(repeats):
            results["hf"].append(hf_in_fresh_process("hf-packed", steps=steps, micro=MICRO, accum=ACCUM, source=source,
                                                     cache_dir=a.cache_dir, arch=arch, bf16=bf16, vocab=VOCAB))
            results["cputrain"].append(run_cputrain(steps, MICRO, MICRO * ACCUM, source, a.cache_dir, arch,
                                                    precision=a.precision, vocab=VOCAB))
            results["cputrain-before"].append(run_cputrain(steps, MICRO, MICRO * ACCUM, source, a.cache_dir, arch,
                                                           before, precision=a.precision, vocab=VOCAB))
            print({k: v[-1]["tokens_per_s"] for k, v in results.items()}, file=sys.stderr)
        tps = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in results.items()}
        last = results["cputrain"][-1]
        mfu = statistics.median(r["mfu"] for r in results["cputrain"])
        mfu_m = statistics.median(r["mfu_of_measured_peak"] for r in results["cputrain"])
        ratio_hf, ratio_before = tps["cputrain"] / tps["hf"], tps["cputrain"] / tps["cputrain-before"]
        spread = {k: f"{min(r['tokens_per_s'] for r in v):,.0f}–{max(r['tokens_per_s'] for r in v):,.0f}"
                  for k, v in results.items()}
        blocks["bf16_end_to_end"] = (f"""### The bf16 step end to end, beside the HF Trainer

{machine_line()}

`python benchmarks/step_time/bf16_step.py --only end-to-end`: the same model, {steps} optimizer steps of
{MICRO * ACCUM} × {seq_len} tokens on `{Path(source).name}` with one {VOCAB}-token BPE, {a.precision}; median of {repeats}.

| run | tokens/s | range | cputrain is |
| --- | ---: | ---: | ---: |
| HF Trainer, run_clm-packed blocks, bf16={bf16} | {tps['hf']:,.0f} | {spread['hf']} | {ratio_hf:.2f}× |
| cputrain with the plain head, SDPA and eager blocks (fused AdamW and the once-per-step cast stay on) | {tps['cputrain-before']:,.0f} | {spread['cputrain-before']} | {ratio_before:.2f}× |
| `cputrain train` (defaults: attention {last['attn_implementation']}, compile {last['compile']}) | {tps['cputrain']:,.0f} | {spread['cputrain']} | 1.00× |

cputrain's MFU: {mfu:.1%} of the theoretical peak ({last['peak_flops'] / 1e9:,.0f} GFLOP/s), {mfu_m:.1%} of the
measured matmul peak ({last['measured_peak_flops'] / 1e9:,.0f} GFLOP/s).
Targets: ≥ 2× the earlier bf16 step: {'met' if ratio_before >= 2 else 'not met'} ({ratio_before:.2f}×); ≥ 1.5× the HF
Trainer packed bf16: {'met' if ratio_hf >= 1.5 else 'not met'} ({ratio_hf:.2f}×).
""")
    for name, text in blocks.items():
        print(text)
        if not a.quick:
            write_block(name, text)


if __name__ == "__main__":
    main()
