"""Online RL's log-probabilities through the whole logits against the block-wise head
(model.chunked_loss, cputrain/kernels/chunked_logps.py): the memory a micro-batch's forward and
backward peak at, what the memory plan counts for the head, and the time, at a small vocabulary and
at Llama-3's and Qwen2.5's. Writes block `rl_head` of docs/benchmarks/online-rl.md.

    python benchmarks/online_rl/rl_head.py            # a few minutes on 2 cores
    python benchmarks/online_rl/rl_head.py --quick    # small shapes, one run: prints the block only

Each case runs in a fresh process: a Llama with random weights (2 blocks, hidden 896 and 14 heads
as Qwen2.5-0.5B's, fp32, or bf16 autocast where the CPU has bf16 units), a micro-batch of 16
completions of 128 tokens, two groups of 8 after a 64-token prompt, laid out as a GRPO step lays
them (cputrain.objectives.rollout_rows at data.seq_len 512); the loss a weighted sum of every
completion token's log-probability at temperature 0.7, then its backward. Peak: the process's high-water
RSS (ru_maxrss) over the first forward and backward less the same before it (the model, its inputs
and the interpreter); time: the median of the calls after that one. The plan's figure is
cputrain.plan.memory.activations.head_bytes for the micro-batch's positions.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.blocks import block_parser, command_as_run, print_and_write_block  # noqa: E402
from benchmarks.runner.machine import machine_line, physical_cores  # noqa: E402

VOCABS = {"8,192 (the benchmarks' BPE)": 8192, "128,256 (Llama-3)": 128_256, "151,936 (Qwen2.5)": 151_936}
ARCH = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 2, "num_attention_heads": 14,
        "num_key_value_heads": 2}
SHAPE = {"groups": 2, "generations": 8, "prompt": 64, "completion": 128, "seq_len": 512}
QUICK_SHAPE = {"groups": 2, "generations": 4, "prompt": 16, "completion": 32, "seq_len": 64}
TEMPERATURE = 0.7
GIB = 2**30


def _case(vocab: int, chunked: bool, precision: str, shape: dict, calls: int) -> dict:
    """One case in this process: its peak over the first call and the median time of the others."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cputrain.kernels.chunked_head import install_chunked_loss
    from cputrain.objectives.rollout_batch import completion_logps, rollout_batch
    from cputrain.objectives.rollout_rows import row_choice
    from cputrain.plan.memory.activations import head_bytes
    from cputrain.plan.model_shape import shape_of

    torch.manual_seed(0)
    config = LlamaConfig(**ARCH, vocab_size=vocab, max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    if chunked:
        install_chunked_loss(model)
    gen = torch.Generator().manual_seed(1)
    prompts, completions = [], []
    for _ in range(shape["groups"]):
        prompt = torch.randint(3, vocab, (shape["prompt"],), generator=gen).tolist()
        for _ in range(shape["generations"]):
            prompts.append(prompt)
            completions.append(torch.randint(3, vocab, (shape["completion"],), generator=gen).tolist())
    choice = row_choice(config, prompts, completions, shape["seq_len"])
    batch = rollout_batch(prompts, completions, pad_id=0, rows=choice.rows)
    weights = torch.linspace(-1, 1, batch.completion_mask.numel()).view(batch.completion_mask.shape)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def call() -> float:
        start = time.perf_counter()
        with autocast:
            logps = completion_logps(model, batch, TEMPERATURE, chunked=chunked)
        (logps * weights).sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    call()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = [call() for _ in range(calls)]
    positions = batch.input_ids.numel()
    planned = head_bytes(shape_of(model), positions, 2 if precision == "bf16" else 4, chunked)
    return {"peak_bytes": peak, "step_s": statistics.median(times), "positions": positions,
            "rows": len(batch.input_ids), "planned_head_bytes": planned}


def main() -> None:
    parser = block_parser("online-rl.md", 3, quick="small shapes, one run: checks the script only")
    parser.add_argument("--case", help="internal: run one case (json) and print its figures")
    args = parser.parse_args()
    if args.case:
        case = json.loads(args.case)
        print(json.dumps(_case(**case)))
        return
    from cputrain.hardware import detect

    precision = "bf16" if detect().has_fast_bf16 else "fp32"
    shape, vocabs, calls = (QUICK_SHAPE, {"1,024": 1024}, 1) if args.quick else (SHAPE, VOCABS, 2)
    runs = 1 if args.quick else args.runs
    cells: dict = {}
    for name, vocab in vocabs.items():
        for run in range(runs):
            for chunked in ((False, True) if run % 2 == 0 else (True, False)):  # alternated, the order swapped
                case = {"vocab": vocab, "chunked": chunked, "precision": precision, "shape": shape, "calls": calls}
                proc = subprocess.run([sys.executable, __file__, "--case", json.dumps(case)], capture_output=True,
                                      text=True, check=True)
                cells.setdefault((name, chunked), []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(name, {k[1]: v for k, v in cells.items() if k[0] == name}, flush=True)
    block = "\n".join(render(cells, vocabs, precision, shape, runs, calls))
    print_and_write_block("rl_head", block, args.doc, args.quick)


def render(cells: dict, vocabs: dict, precision: str, shape: dict, runs: int, calls: int) -> list[str]:
    first = next(iter(cells.values()))[0]
    lines = [machine_line(), "",
             f"A micro-batch of {shape['groups'] * shape['generations']} completions of {shape['completion']} tokens "
             f"({shape['groups']} groups of {shape['generations']} after a {shape['prompt']}-token prompt, "
             f"{first['rows']} rows, {first['positions']:,} positions), a Llama of 2 blocks, hidden 896, "
             f"{precision}, {physical_cores()} threads, temperature {TEMPERATURE}; forward and backward of the "
             f"log-probabilities. Peak: above the process before the first call; time: median of {calls} calls "
             f"after it; each the median of {runs} run(s), the two heads alternated (`{command_as_run()}`).", "",
             "| vocabulary | head | peak GiB | planned head GiB | s per forward + backward | peak ÷ whole logits' | "
             "time ÷ whole logits' |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in vocabs:
        whole = {k: statistics.median(r[k] for r in cells[name, False]) for k in ("peak_bytes", "step_s")}
        for chunked in (False, True):
            runs_ = cells[name, chunked]
            peak = statistics.median(r["peak_bytes"] for r in runs_)
            step = statistics.median(r["step_s"] for r in runs_)
            lines.append(f"| {name} | {'block-wise' if chunked else 'whole logits'} | {peak / GIB:.2f} | "
                         f"{runs_[0]['planned_head_bytes'] / GIB:.2f} | {step:.2f} | "
                         f"{peak / whole['peak_bytes']:.2f} | {step / whole['step_s']:.2f} |")
    return lines


if __name__ == "__main__":
    main()
