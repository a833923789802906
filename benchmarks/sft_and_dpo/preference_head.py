"""What DPO's and SimPO's head costs: each answer token's log-probability from the whole logits
(objectives.preference_loss.sequence_logps, the plain head) against the block-wise head
(kernels/chunked_logps.py, model.chunked_loss), forward and backward, peak memory and time.
Writes block preference_head of docs/benchmarks/sft-and-dpo.md.

    python benchmarks/sft_and_dpo/preference_head.py            # Llama-3's vocabulary, 512 / 1,024 / 2,048 tokens
    python benchmarks/sft_and_dpo/preference_head.py --quick    # 512 tokens only, one repeat

The head alone on random hidden states: a frozen bf16 head (LoRA: only the hidden states'
gradient) and a trained fp32 head (full weights: its gradient too), under bf16 autocast where the
CPU has AVX512-BF16 or AMX (else fp32), the loss weighing each sequence differently as DPO's does.
Each measurement runs in a fresh process; peak RSS is the process's high-water mark above what
it held before the head's forward; time the median of the repeats after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.blocks import write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402

VOCAB = 128_256  # Llama-3's
HIDDEN = 2048


def _high_water_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def measure_one(head_kind: str, path: str, tokens: int, precision: str, repeats: int) -> dict:
    """In this process: one head, one path; peak bytes above the start and step seconds."""
    import torch

    from cputrain.kernels.chunked_logps import chunked_token_logps
    from cputrain.objectives.preference_loss import sequence_logps, sums_by_sequence

    torch.manual_seed(0)
    torch.set_num_threads(torch.get_num_threads())
    trained = head_kind == "trained (full weights)"
    weight = (torch.randn(VOCAB, HIDDEN) * 0.02).to(torch.float32 if trained else torch.bfloat16)
    weight.requires_grad_(trained)
    rows, seq = 2, tokens // 2
    hidden = torch.randn(rows, seq, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (rows, seq))
    labels[:, : seq // 8] = -100  # the prompts
    sequence_ids = torch.zeros(rows, seq, dtype=torch.long)
    sequence_ids[:, seq // 2 :] = 1
    sequence_ids += 2 * torch.arange(rows)[:, None]
    weights = torch.linspace(-1.0, 1.0, 2 * rows)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def step() -> None:
        with autocast:
            h = hidden.to(torch.bfloat16) if precision == "bf16" else hidden
            if path == "block-wise":
                token_logps = chunked_token_logps(h, weight, labels)
                sums, _ = sums_by_sequence(token_logps, labels, sequence_ids, 2 * rows)
            else:
                logits = h @ weight.to(h.dtype).t()
                sums, _ = sequence_logps(logits, labels, sequence_ids, 2 * rows)
                del logits
        (sums * weights).sum().backward()
        hidden.grad = None
        weight.grad = None

    step()  # warm-up: kernels, allocator
    start = _resident_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again here
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"peak_gib": (_high_water_bytes() - start) / 2**30, "step_s": statistics.median(times)}


def run(head_kind: str, path: str, tokens: int, precision: str, repeats: int) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(REPO)!r}); from benchmarks.sft_and_dpo.preference_head import measure_one; "
            f"print(json.dumps(measure_one({head_kind!r}, {path!r}, {tokens}, {precision!r}, {repeats})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20), **__import__("os").environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from cputrain.hardware import detect

    flags = detect().flags
    precision = "bf16" if flags.get("amx_bf16") or flags.get("avx512_bf16") else "fp32"
    sizes, repeats = ([512], 1) if args.quick else ([512, 1024, 2048], 3)
    lines = [machine_line(), "",
             f"Head {VOCAB:,} × {HIDDEN:,} (Llama-3's vocabulary), {precision}, forward + backward of per-sequence "
             "log-probabilities weighted as DPO's loss weighs them; peak = high-water RSS above the start "
             "(a fresh process per row), time = median of "
             f"{repeats} after a warm-up. `benchmarks/sft_and_dpo/preference_head.py`.", "",
             "| head | tokens | plain peak GiB | block-wise peak GiB | plain s | block-wise s | block-wise ÷ plain time |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for head_kind in ("frozen (LoRA)", "trained (full weights)"):
        for tokens in sizes:
            plain = run(head_kind, "plain", tokens, precision, repeats)
            block = run(head_kind, "block-wise", tokens, precision, repeats)
            row = (f"| {head_kind} | {tokens:,} | {plain['peak_gib']:.2f} | {block['peak_gib']:.2f} | "
                   f"{plain['step_s']:.2f} | {block['step_s']:.2f} | {block['step_s'] / plain['step_s']:.2f} |")
            print(row, flush=True)
            lines.append(row)
    lines += ["", "The plain head grows with the tokens (about three fp32 copies of the micro-batch's logits); the "
              "block-wise one is bounded by a 256 MiB block once the micro-batch holds more than a block, plus, for "
              "a trained head, its fp32 gradient and the logits' gradient in the compute dtype."]
    write_block("preference_head", "\n".join(lines))


if __name__ == "__main__":
    main()
