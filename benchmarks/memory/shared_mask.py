"""What a row's own 4D mask costs a forward under sdpa: the bool mask against the additive one
cputrain gives the model (cputrain.data.batch.attention_mask_for). Writes block shared_mask of
docs/benchmarks/memory.md.

    python benchmarks/memory/shared_mask.py            # ~2 min on 2 cores: run it alone
    python benchmarks/memory/shared_mask.py --quick    # one width, one run: checks the script only

Rows where sequences share a prompt (preference pairs with data.shared_prompt, online RL's groups
laid out after one prompt) carry a [rows, 1, W, W] mask. Given a bool one, sdpa converts it to the
queries' dtype in every layer, and each layer's autograd keeps its copy until the backward. A
16-layer Llama (hidden 64, so that the mask, not the activations, is what grows), fp32 weights
under bf16 autocast as the single and ddp strategies run, one row of W tokens, each case in a fresh
process: the RSS the forward leaves held for the backward (with glibc's mmap threshold fixed at
128 KiB, so that RSS follows what is alive), and the forward and backward's time. Medians of the
runs, the kinds alternated.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.blocks import block_parser, command_as_run, print_and_write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402

LAYERS = 16
WIDTHS = (512, 1024, 2048)

# One case in a fresh interpreter: prints {"held_mib": ..., "step_s": ...}
CASE = r"""
import gc, json, sys, time
import psutil, torch
from transformers import LlamaConfig, LlamaForCausalLM
from cputrain.data.batch import attention_mask_for
kind, width, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                     attn_implementation="sdpa"))
ids = torch.randint(0, 256, (1, width))
mask = torch.ones(width, width, dtype=torch.bool).tril_()[None, None]
with torch.autocast("cpu", dtype=torch.bfloat16):
    model(input_ids=ids[:, :64], attention_mask=mask[..., :64, :64]).logits.float().sum().backward()  # kernels warmed
    model.zero_grad(set_to_none=True)
    given = mask if kind == "bool" else attention_mask_for(mask, model)
    gc.collect()
    before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    logits = model(input_ids=ids, attention_mask=given).logits
    held = psutil.Process().memory_info().rss - before
loss = logits.float().sum()
loss.backward()
print(json.dumps({"held_mib": held / 2**20, "step_s": time.perf_counter() - start}))
"""


def run_case(kind: str, width: int) -> dict:
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", CASE, kind, str(width), str(LAYERS)], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    args = block_parser("memory.md", 3, quick="one width, one run: checks the script only").parse_args()
    widths, runs = ((256,), 1) if args.quick else (WIDTHS, args.runs)
    lines = [machine_line(), "", f"`{command_as_run()}`: a {LAYERS}-layer Llama (hidden 64), fp32 weights under "
             "bf16 autocast, one row of W tokens with a causal mask given as a 4D mask, sdpa; RSS held after the "
             f"forward (glibc's mmap threshold at 128 KiB), median of {runs} run(s), each a fresh process. One bf16 "
             "copy of the mask is W² × 2 bytes.", "",
             "| W | one bf16 copy MiB | bool: held MiB | additive: held MiB | bool − additive ÷ one copy | "
             "bool: forward+backward s | additive: s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for width in widths:
        cases = {"bool": [], "additive": []}
        for _ in range(runs):
            for kind in cases:
                cases[kind].append(run_case(kind, width))
        held = {k: statistics.median(c["held_mib"] for c in v) for k, v in cases.items()}
        step = {k: statistics.median(c["step_s"] for c in v) for k, v in cases.items()}
        copy_mib = width * width * 2 / 2**20
        lines.append(f"| {width} | {copy_mib:.1f} | {held['bool']:.1f} | {held['additive']:.1f} | "
                     f"{(held['bool'] - held['additive']) / copy_mib:.1f} | {step['bool']:.3f} | {step['additive']:.3f} |")
        print(lines[-1], flush=True)
    print_and_write_block("shared_mask", "\n".join(lines), args.doc, args.quick)


if __name__ == "__main__":
    main()
