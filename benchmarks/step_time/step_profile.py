"""Where one training step of the side-by-side model spends its time, and what the usual
speed-ups do to it. The packed Trainer and cputrain run the same Hugging Face model code, so
what separates them is what is left outside these operators.

    python benchmarks/step_time/step_profile.py            # the figures, written to docs/benchmarks/step-time.md
    python benchmarks/step_time/step_profile.py --quick    # a tiny model: checks the script only

Each variant runs in a fresh process (forward with labels, backward, foreach AdamW, as
cputrain's train_step does), interleaved over repetitions; the step time is the median of the
timed steps after warm-up. The operator shares come from torch.profiler's self CPU time over
the eager SDPA steps, with the matmul rate from its FLOP count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.processes import run_child  # noqa: E402
from benchmarks.runner.timing import time_steps  # noqa: E402
from benchmarks.runner.machine import physical_cores  # noqa: E402
from benchmarks.vs_hf_trainer.vs_hf_trainer import ARCH, SEQ_LEN, VOCAB  # noqa: E402

MICRO_BATCH = 4
VARIANTS = {
    "eager, SDPA attention (cputrain's default)": {"attn": "sdpa", "compile": False},
    "eager, attention as plain matmul + softmax": {"attn": "eager", "compile": False},
    "each decoder block compiled (inductor)": {"attn": "sdpa", "compile": True},
}
# operator name → row of the breakdown (self time; anything else is "elementwise and other")
MATMULS = "matrix products (mm, addmm, bmm)"
CATEGORIES = {
    MATMULS: ("aten::mm", "aten::addmm", "aten::bmm"),
    "attention (SDPA flash kernel, forward and backward)": ("aten::_scaled_dot_product",),
    "cross-entropy (log-softmax, NLL)": ("aten::_log_softmax", "aten::nll_loss"),
}


def build(arch: dict, attn: str):
    import torch
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    config = CONFIG_MAPPING[arch["model_type"]](**{k: v for k, v in arch.items() if k != "model_type"},
                                                vocab_size=VOCAB)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def child(opts: dict) -> dict:
    import torch

    torch.set_num_threads(physical_cores())
    model = build(opts["arch"], opts["attn"])
    if opts["compile"]:  # what model.compile=true does in a run
        from cputrain.model import compile_blocks

        compile_blocks(model, str(REPO / ".cache" / "bench" / "inductor"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, opts["seq_len"]))

    def step():
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    out = {"step_s": time_steps(step, opts["steps"], warmup=3)["step_s"]}  # warm-up: allocation, compilation
    if opts.get("profile"):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
            for _ in range(opts["steps"]):
                step()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        shares = {name: 0.0 for name in CATEGORIES}
        for e in events:
            for name, prefixes in CATEGORIES.items():
                if e.key.startswith(prefixes):
                    shares[name] += e.self_cpu_time_total / total
                    break
        matmuls = [e for e in events if e.key.startswith(CATEGORIES[MATMULS])]
        mm_time_us = sum(e.self_cpu_time_total for e in matmuls)
        mm_flops = sum(e.flops or 0 for e in matmuls)
        shares["elementwise and other (norms, activations, RoPE, optimizer, copies)"] = 1 - sum(shares.values())
        out["shares"] = shares
        out["mm_gflops"] = mm_flops / (mm_time_us * 1e-6) / 1e9 if mm_time_us else 0.0
        from benchmarks.vs_hf_trainer.vs_hf_trainer import matmul_rate

        out["peak_mm_gflops"] = matmul_rate(opts["peak_n"], repeats=5) / 1e9
    return out


def in_fresh_process(opts: dict) -> dict:
    return run_child(__file__, json.dumps(opts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, one repetition, print only")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions of each variant (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (default: %(default)s)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    arch = {**ARCH, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2} if a.quick else ARCH
    seq_len, repeats, steps = (64, 1, 2) if a.quick else (SEQ_LEN, a.repeats, a.steps)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(repeats):  # interleaved, so a slow spell of the machine hits every variant
        for name, v in VARIANTS.items():
            times[name].append(in_fresh_process({"arch": arch, "seq_len": seq_len, "steps": steps, **v})["step_s"])
    prof = in_fresh_process({"arch": arch, "seq_len": seq_len, "steps": steps, "attn": "sdpa", "compile": False,
                             "profile": True, "peak_n": 1024 if a.quick else 4096})
    from benchmarks.runner.blocks import write_block_and_say
    from benchmarks.runner.machine import machine_line

    base = statistics.median(times[next(iter(VARIANTS))])
    compiled = base / statistics.median(times["each decoder block compiled (inductor)"])
    compile_verdict = (f"compiling the blocks made the step {compiled:.2f}× as fast" if compiled >= 1.0 else
                       f"compiling the blocks made the step slower ({compiled:.2f}× the default's speed)")
    tokens = MICRO_BATCH * seq_len
    rows = "\n".join(f"| {name} | {statistics.median(t):.3f} | {tokens / statistics.median(t):,.0f} | "
                     f"{tokens / max(t):,.0f}–{tokens / min(t):,.0f} | {base / statistics.median(t):.2f}× |"
                     for name, t in times.items())
    shares = "\n".join(f"| {name} | {share:.1%} |" for name, share in prof["shares"].items())
    table = f"""### Where a training step's time goes

{machine_line()}

`python benchmarks/step_time/step_profile.py`: the model of the Trainer comparison ({arch['hidden_size']} wide,
{arch['num_hidden_layers']} layers, {VOCAB}-token vocabulary), micro-batch {MICRO_BATCH} × {seq_len} tokens,
forward + backward + AdamW, fp32, {physical_cores()} threads; median step of {steps} timed steps, median over
{repeats} fresh process(es) per variant.

| variant | step (s) | tokens/s | range over the processes | vs default |
| --- | ---: | ---: | ---: | ---: |
{rows}

Self time by operator, eager SDPA (torch.profiler, {steps} steps):

| operators | share of the step |
| --- | ---: |
{shares}

The step's matrix products ran at {prof['mm_gflops']:.0f} GFLOP/s; a {'1024' if a.quick else '4096'}² `torch.mm` in the same
process at {prof['peak_mm_gflops']:.0f} GFLOP/s. cputrain and the packed Trainer spend their steps in these same
operators of the same model code; {compile_verdict}.
"""
    print(table)
    if not a.quick:
        write_block_and_say("step_profile", table)


if __name__ == "__main__":
    main()
