"""Preference pairs with the prompt laid out once per pair (data.shared_prompt=true) against the
two whole sequences (false): LoRA DPO, pairs/s and tokens/s at three prompt shares. Writes block
shared_prompt of docs/benchmarks/sft-and-dpo.md.

    python benchmarks/sft_and_dpo/shared_prompt.py            # ~100M Llama, 3 shares × 2 layouts × 3 runs: run it alone
    python benchmarks/sft_and_dpo/shared_prompt.py --quick    # a tiny model, 3 steps, one run, prints the block only
    python benchmarks/sft_and_dpo/shared_prompt.py --quick --doc /tmp/b      # … and writes it into /tmp/b/sft-and-dpo.md (checks write_block)

The model: a ~100M-parameter Llama (benchmarks/sft_and_dpo/sft.py's shape) with random weights, saved as a
Hugging Face folder with the byte-level BPE of benchmarks/runner/base_model.py (trained on builtin:pydoc).
The pairs: plain strings, a prompt cut from one of pydoc's help topics and two answers cut from
two others, the prompt ~10%, ~30% or ~50% of each sequence's characters (each sequence ~SEQ_CHARS
characters, ~170 tokens), so a pair's prompt is ~that share of its two sequences' tokens (the
share saved, measured in the token cache, is in the table). Every run: `cputrain train`,
data.format=preference, train.objective=dpo, LoRA rank 16 on all seven projections, rows of 2,048
tokens (several pairs each, so the tokens saved become pairs per row), 2 rows a step (2
micro-batches of 1), bf16 where the CPU has AVX512-BF16 or AMX, else fp32.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.base_model import make_base  # noqa: E402
from benchmarks.runner.cputrain_run import train_measured  # noqa: E402
from benchmarks.runner.timing import steady_median  # noqa: E402
from benchmarks.runner.blocks import block_parser, print_and_write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402
from benchmarks.sft_and_dpo.sft import ARCH_100M, QUICK_ARCH  # noqa: E402

SHARES = (0.1, 0.3, 0.5)  # the prompt's part of each sequence's characters
SEQ_LEN, SEQ_CHARS, QUICK_SEQ_LEN, QUICK_SEQ_CHARS = 2048, 600, 256, 120
ROWS, MICRO = 2, 1  # rows per step, rows per micro-batch
RANK, ALPHA, LR, BETA, SEED = 16, 32.0, 5e-5, 0.1, 1337
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

EXPLANATION = """\
The prompt of a preference pair is the same in its chosen and rejected sequences. Laid out as two
whole sequences (data.shared_prompt=false) it is computed twice; shared (true, preference data's
auto), the row holds prompt + chosen, then one copy of the prompt's last shared token at its
position and the rejected answer, which attends to the prompt through a 4D attention mask. A pair
then takes (its prompt's tokens − 1) fewer positions, so a row of data.seq_len holds more pairs and
a step of rows trains more of them; the log-probabilities are the same (tests/unit/test_shared_prompt.py).
Packed unshared pairs already run under a 4D mask (transformers builds it from the restarting
positions), so a position costs the same in both layouts: tokens/s should stay level and pairs/s
rise with the prompt's share. Pairs/s counts the pairs of the steps after the warm-up ÷ their
time; tokens/s the row positions run (padding included) ÷ time; "saved" is the share of the pairs'
two sequences' tokens the shared layout leaves out (stats.json of the token cache). Attention is
sdpa in every run: left to auto, each run times both kernels and may take either (a first run of
this script under auto measured the shared layout at 0.93× the pairs/s at ~10%, one run each, which
the mask itself does not explain: forward + backward of four 768-wide blocks at 2,048 tokens took
the same time, 2.6 s, under transformers' mask from the positions and under an explicit 4D mask)."""


def write_pairs(path: Path, n: int, share: float, seq_chars: int, seed: int = SEED) -> None:
    """`n` string pairs whose prompt is `share` of each sequence's ~seq_chars characters."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    texts = [" ".join(topics[name].split()) for name in sorted(topics)]
    texts = [t for t in texts if len(t) > seq_chars]

    def cut(chars: int) -> str:
        text = rng.choice(texts)
        start = rng.randrange(0, len(text) - chars)
        return text[start: start + chars]

    frame = ("Question: ", "\nAnswer:")
    prompt_chars, answer = int(share * seq_chars), seq_chars - int(share * seq_chars)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": frame[0] + cut(prompt_chars - sum(map(len, frame))) + frame[1],
                                "chosen": " " + cut(answer), "rejected": " " + cut(answer)}) + "\n")


def run_cputrain(base: str, data: Path, shared: bool, steps: int, warmup: int, seq_len: int, cache_dir: str,
                 precision: str) -> dict:
    run = train_measured([
        f"model.name_or_path={base}", f"data.source={data}", "data.format=preference", f"data.seq_len={seq_len}",
        "data.val_fraction=0", f"data.cache_dir={cache_dir}", f"data.shared_prompt={str(shared).lower()}",
        "train.objective=dpo", f"train.dpo_beta={BETA}", f"train.max_steps={steps}", f"train.global_batch_size={ROWS}",
        f"train.micro_batch_size={MICRO}", f"train.lr={LR}", "train.warmup_steps=0", "train.log_every=1",
        "train.eval_every=100000", "train.checkpoint_every=100000", "train.sample_tokens=0",
        f"hardware.precision={precision}", f"seed={SEED}", "model.lora.enabled=true",
        f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "model.lora.dropout=0.0",
        f"model.lora.target_modules=[{','.join(TARGETS)}]",
        # auto times both kernels in each run and may take either (sdpa measured 1.6× eager
        # at 2,048 tokens): the layouts are compared on one kernel
        "model.attn_implementation=sdpa"])
    rows = [r for r in run.metrics_rows if "step_time_s" in r]
    config, process_peak = run.config_yaml, run.process_peak_rss_gib
    assert f"shared_prompt: {str(shared).lower()}" in config, "the run did not take data.shared_prompt"
    stats = json.loads(next(Path(cache_dir).glob("packed/*/stats.json")).read_text())
    return {"pairs_per_s": steady_median([r["pairs_per_s"] for r in rows], warmup),
            "tokens_per_s": steady_median([r["tokens_per_s"] for r in rows], warmup),
            "step_time_s": steady_median([r["step_time_s"] for r in rows], warmup),
            "first_loss": rows[0]["loss"], "train_pairs": stats["train_pairs"],
            "process_peak_rss_gib": process_peak}


def saved_share(cache_dir: str, seq_len: int) -> float:
    """The share of the pairs' two sequences' tokens the shared layout leaves out, from the cache."""
    from cputrain.data.preference.rows import open_pairs

    folder = next(Path(cache_dir).glob("packed/*/stats.json")).parent
    return open_pairs(folder, packing=True, shared_prompt=True).stats["shared_prompt_saved_share"]


def main() -> None:
    parser = block_parser("sft-and-dpo.md", 3, quick="tiny model, 3 steps, one run: checks the script only")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    from cputrain.hardware import detect

    bf16 = detect().has_fast_bf16
    precision = "bf16" if bf16 else "fp32"
    steps, warmup, runs = (3, 1, 1) if args.quick else (args.steps, 2, args.runs)
    seq_len, seq_chars = (QUICK_SEQ_LEN, QUICK_SEQ_CHARS) if args.quick else (SEQ_LEN, SEQ_CHARS)
    work = Path(tempfile.mkdtemp(prefix="cputrain-shared-prompt-bench-"))
    tokenizer_cache = str(work / "tokenizer-cache")
    base = make_base(work / "base", QUICK_ARCH if args.quick else ARCH_100M, "builtin:pydoc", tokenizer_cache,
                     "bfloat16" if bf16 else "float32")
    # more pairs than the steps take, whatever a row holds (a pair is over 50 tokens)
    n_pairs = ROWS * steps * (seq_len // 50) + 32
    cells = {}
    for share in SHARES:
        data = work / f"pairs-{share:.1f}.jsonl"
        write_pairs(data, n_pairs, share, seq_chars)
        cells[share] = {"data": data, "cache": str(work / f"cache-{share:.1f}"), True: [], False: []}
    for _ in range(runs):  # alternated: every cell once per round, shared and not one after the other
        for share, cell in cells.items():
            for shared in (True, False):
                result = run_cputrain(str(work / "base"), cell["data"], shared, steps, warmup, seq_len,
                                      cell["cache"], precision)
                cell[shared].append(result)
                print(f"prompt {share:.0%} shared={shared}", json.dumps(result), flush=True)
    for cell in cells.values():
        cell["saved"] = saved_share(cell["cache"], seq_len)
    block = "\n".join(render(cells, base["parameters"], precision, steps, runs, seq_len))
    print_and_write_block("shared_prompt", block, args.doc, args.quick)


def render(cells: dict, parameters: int, precision: str, steps: int, runs: int, seq_len: int) -> list[str]:
    def med(results: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in results)

    lines = [machine_line(), "", EXPLANATION, "",
             f"{parameters / 1e6:.1f}M Llama ({precision}), LoRA rank {RANK} DPO, rows of {seq_len} tokens, "
             f"{ROWS} rows a step, {steps} steps, median of {runs} alternated runs per cell "
             "(`python benchmarks/sft_and_dpo/shared_prompt.py`).", "",
             "| prompt share | saved | pairs/s unshared | pairs/s shared | × | tokens/s unshared | tokens/s shared | × |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for share, cell in cells.items():
        pu, ps = med(cell[False], "pairs_per_s"), med(cell[True], "pairs_per_s")
        tu, ts = med(cell[False], "tokens_per_s"), med(cell[True], "tokens_per_s")
        lines.append(f"| ~{share:.0%} | {cell['saved']:.1%} | {pu:.2f} | {ps:.2f} | {ps / pu:.2f}× | {tu:,.0f} | "
                     f"{ts:,.0f} | {ts / tu:.2f}× |")
    firsts = [r["first_loss"] for cell in cells.values() for shared in (True, False) for r in cell[shared]]
    lines += ["", f"First-step loss of every run: {min(firsts):.4f}–{max(firsts):.4f} (ln 2 = {math.log(2):.4f}: "
                  "the policy is its reference before any update)."]
    return lines


if __name__ == "__main__":
    main()
