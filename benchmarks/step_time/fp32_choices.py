"""Each speed default of the training step, measured in fp32 on this machine: the chunked head +
loss, fused AdamW, the attention kernel, the memory allocator and OpenMP thread binding, on three
shapes. Writes one block per shape (fp32_choices-demo, -100m, -128k-head) of docs/benchmarks/step-time.md; cputrain's `auto` values for fp32 are
read from these figures (cputrain/config/resolve.py says which row each choice comes from).

    python benchmarks/step_time/fp32_choices.py            # the figures
    python benchmarks/step_time/fp32_choices.py --quick    # tiny shapes, one round: checks the script only

Shapes: the demo (`cputrain train`'s model and batch), a ~100M Llama (768 wide, 12 layers,
8,192-token vocabulary, 4 × 512 tokens a step) and the demo's body under a Llama-3-sized head
(128,256-token vocabulary, 1 GiB per fp32 logits copy at 2,048 tokens).

Step choices are compared in ONE process, step by step in turn (baseline, then each change,
round after round): pairs that share the process, its heap and the machine's slow spells, which
fresh processes per variant do not. What only a new process can change (the preloaded malloc,
OpenMP binding) runs the baseline step in its own process, interleaved with the others.
Once-per-step casting is a bf16 autocast matter: an fp32 step has no autocast, so no row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.processes import run_child  # noqa: E402
from cputrain.config import DEFAULT_ARCH  # noqa: E402

ARCH_100M = {**DEFAULT_ARCH, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 12, "tie_word_embeddings": False}
SHAPES = {
    "demo": {"arch": DEFAULT_ARCH, "vocab": 4096, "seq_len": 256, "micro": 4, "accum": 2},
    "~100M": {"arch": ARCH_100M, "vocab": 8192, "seq_len": 512, "micro": 4, "accum": 1},
    "128k head": {"arch": DEFAULT_ARCH, "vocab": 128_256, "seq_len": 256, "micro": 8, "accum": 1},
}
QUICK_ARCH = {**DEFAULT_ARCH, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
QUICK_SHAPES = {"demo": {"arch": QUICK_ARCH, "vocab": 512, "seq_len": 64, "micro": 2, "accum": 2}}

# The step's choices, each one change from the baseline (what `cputrain train` ran before these measurements).
CHOICES = {
    "baseline: chunked head + loss, fused AdamW, SDPA, glibc malloc": {},
    "plain head + loss (model.chunked_loss=false)": {"chunked": False},
    "foreach AdamW (not fused)": {"fused": False},
    "eager attention (matmul + softmax)": {"attn": "eager"},
}
LIBS = "/usr/lib/x86_64-linux-gnu"
# Process-wide settings: the baseline step, each in its own processes.
PROCESS_VARIANTS = {
    "jemalloc (LD_PRELOAD)": {"LD_PRELOAD": f"{LIBS}/libjemalloc.so.2"},
    "tcmalloc (LD_PRELOAD)": {"LD_PRELOAD": f"{LIBS}/libtcmalloc.so.4"},
    "OMP_PROC_BIND=close, OMP_PLACES=cores": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
}


def step_child(opts: dict) -> dict:
    """Build the shape's model once and time the named choices in turn; per choice the step
    times and the step's peak RSS (GiB)."""
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from cputrain.kernels.chunked_head import install_chunked_loss
    from cputrain.metrics import memory

    torch.set_num_threads(opts["threads"])
    shape = opts["shape"]
    arch = dict(shape["arch"])
    config = CONFIG_MAPPING[arch.pop("model_type")](**arch, vocab_size=shape["vocab"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    plain_forward = model.forward
    install_chunked_loss(model)
    chunked_forward = model.forward
    params = [p for p in model.parameters()]
    optimizers = {True: torch.optim.AdamW(params, lr=1e-5, fused=True),
                  False: torch.optim.AdamW(params, lr=1e-5, foreach=True)}
    tokens = [torch.randint(0, shape["vocab"], (shape["micro"], shape["seq_len"])) for _ in range(shape["accum"])]
    targets = sum(t.numel() for t in tokens)

    def step(choice: dict) -> None:
        model.forward = chunked_forward if choice.get("chunked", True) else plain_forward
        model.set_attn_implementation(choice.get("attn", "sdpa"))
        optimizer = optimizers[choice.get("fused", True)]
        for ids in tokens:
            model(input_ids=ids, labels=ids, num_items_in_batch=targets).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    choices = {name: CHOICES[name] for name in opts["choices"]}
    times: dict[str, list[float]] = {name: [] for name in choices}
    peaks: dict[str, float] = {name: 0.0 for name in choices}
    for name, choice in choices.items():  # warm-up: first-call allocation, kernel selection
        step(choice)
    for _ in range(opts["rounds"]):
        for name, choice in choices.items():
            memory.reset_peak()
            t0 = time.perf_counter()
            step(choice)
            times[name].append(time.perf_counter() - t0)
            peaks[name] = max(peaks[name], memory.peak_rss_gib())
    return {"times": times, "peaks": peaks, "tokens_per_step": targets}


def in_process(opts: dict, extra_env: dict) -> dict:
    with mock.patch.dict(os.environ, extra_env):  # the child inherits it (run_child copies os.environ)
        return run_child(__file__, json.dumps(opts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="processes per variant, interleaved")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps per choice in each process")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of: " + ", ".join(SHAPES))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(step_child(json.loads(a.child))))
        return
    from benchmarks.runner.blocks import write_block_and_say
    from benchmarks.runner.machine import machine_line
    from benchmarks.runner.machine import physical_cores

    shapes = QUICK_SHAPES if a.quick else {k: SHAPES[k] for k in a.shapes.split(",")}
    repeats, rounds = (1, 1) if a.quick else (a.repeats, a.rounds)
    threads = physical_cores()
    variants = {k: v for k, v in PROCESS_VARIANTS.items() if not v.get("LD_PRELOAD") or os.path.exists(v["LD_PRELOAD"])}
    for shape_name, shape in shapes.items():
        steps: dict[str, list[float]] = {}
        peaks: dict[str, list[float]] = {}
        tokens_per_step = 0
        for rep in range(repeats):  # interleaved: a slow spell of the machine hits every variant
            runs = [("", {}, list(CHOICES))] + [(name, env, [next(iter(CHOICES))]) for name, env in variants.items()]
            for label, env, choice_names in runs:
                out = in_process({"shape": shape, "threads": threads, "rounds": rounds, "choices": choice_names}, env)
                tokens_per_step = out["tokens_per_step"]
                for choice, ts in out["times"].items():
                    key = label or choice
                    steps.setdefault(key, []).extend(ts)
                    peaks.setdefault(key, []).append(out["peaks"][choice])
                print(shape_name, label or "choices", {k: round(statistics.median(v), 3) for k, v in out["times"].items()},
                      file=sys.stderr)
        base = statistics.median(steps[next(iter(CHOICES))])
        rows = []
        for key, ts in steps.items():
            step_s = statistics.median(ts)
            rows.append(f"| {key} | {step_s:.3f} | {tokens_per_step / step_s:,.0f} | {base / step_s:.2f}× | "
                        f"{max(peaks[key]):.2f} |")
        arch = shape["arch"]
        slug = shape_name.strip("~").replace(" ", "-").lower()
        text = f"""### The fp32 step, {shape_name}: each speed default measured in fp32

{machine_line()}

`python benchmarks/step_time/fp32_choices.py --shapes {shape_name}`: Llama {arch['hidden_size']} wide, {arch['num_hidden_layers']} layers,
{shape['vocab']:,}-token vocabulary, {shape['accum']} × {shape['micro']} × {shape['seq_len']} tokens a step; forward with labels,
backward, clip, AdamW, fp32, {threads} threads. The step's choices alternate step by step in one process
({repeats} process(es), {len(steps[next(iter(CHOICES))])} timed steps per row); the allocator and OpenMP rows run the
baseline step in their own processes, interleaved. Median step time; "vs baseline" above 1 is faster than the
baseline. Step peak: the highest RSS of one step.

| variant | step (s) | tokens/s | vs baseline | step peak RSS (GiB) |
| --- | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}
"""
        print(text)
        if not a.quick:
            write_block_and_say(f"fp32_choices-{slug}", text)


if __name__ == "__main__":
    main()
