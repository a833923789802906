"""cputrain against the Hugging Face Trainer: the same Llama, corpus, tokenizer, batch and threads,
this machine, at three sizes (the demo's model, ~30M, ~100M) and in each precision the CPU runs
natively (fp32 always; bf16 where it has AMX or AVX512-BF16), with the ceiling this machine's matrix
products set. Writes its table to docs/benchmarks/vs-hf-trainer.md (block vs_hf_trainer, or the name block_name()
gives: precisions other than fp32, a CPU other than AVX2, torch's kernels limited by ATEN_CPU_CAPABILITY).

    python benchmarks/vs_hf_trainer/vs_hf_trainer.py            # full run, several repetitions, writes the doc
    python benchmarks/vs_hf_trainer/vs_hf_trainer.py --quick    # smoke: the demo size only, one repetition, prints only

Configurations, each in a fresh process per repetition, alternated (medians reported):
  hf-padded  the common recipe (demo size only): one record per example, padded to 512 tokens,
             per_device_train_batch_size=1, gradient_accumulation_steps=4
  hf-packed  the Trainer given already-packed data (run_clm's concatenate-and-chunk), with
             cputrain's batch: micro-batch and accumulation the same
  cputrain   `cputrain train` through its real code path (subprocess, summary.json), every
             setting at its default for that precision
  ceiling    the same step's matrix products and attention kernel alone, each timed in isolation
             (benchmarks/vs_hf_trainer/step_ceiling.py): the fastest a step that runs the model's products at
             these shapes could be here, whatever else it does faster
Useful tokens are the non-padding ones. Also measured here: the fp32 rate of a large torch.mm,
the MFU of the ~30M model against that measured rate, the time from command to first training
step of the default run (tokenizer cached), and the full default run from a fresh cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.base_model import shared_tokenizer  # noqa: E402
from benchmarks.runner.machine import physical_cores  # noqa: E402
from benchmarks.runner.processes import env  # noqa: E402

# The model of the side-by-side runs: the built-in demo's Llama.
ARCH = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}
# ~30M parameters (27M non-embedding with the tied head) for the MFU figure at seq_len 512.
ARCH_30M = {**ARCH, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
            "num_attention_heads": 8, "num_key_value_heads": 8}
# ~100M: 768 wide, 12 layers, an 8,192-token vocabulary and an untied head (97M parameters).
ARCH_100M = {**ARCH, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 12, "tie_word_embeddings": False}
VOCAB = 4096
VOCAB_100M = 8192
SEQ_LEN = 512
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # torch dtype names per precision
PAD_TO = 512  # the recipe's max_length="max_length" padding
LR, WARMUP, SEED = 3e-3, 2, 1337
# What cputrain is asked to reach against the packed Trainer, at every size; set against the ceiling.
SPEEDUP_TARGET = {"fp32": 1.1, "bf16": 1.5}


# ------------------------------------------------------------------------------------------
# Shared inputs: the corpus (its tokenizer: benchmarks.runner.base_model.shared_tokenizer), used by all.


def corpus_documents(source: str) -> list[str]:
    from cputrain.config import DataConfig
    from cputrain.data.sources import read_documents

    return read_documents(DataConfig(source=source))


# ------------------------------------------------------------------------------------------
# One Trainer run (runs in its own process; prints one JSON line).


def packed_rows(tok, docs: list[str], seq_len: int) -> list[dict]:
    """run_clm.py's group_texts: every document joined (EOS between), cut into `seq_len` blocks."""
    import torch

    ids = [t for d in tok(docs, add_special_tokens=False)["input_ids"] for t in d + [tok.eos_token_id]]
    n = len(ids) // seq_len
    blocks = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    return [{"input_ids": b, "attention_mask": torch.ones_like(b), "labels": b} for b in blocks]


class RowsDataset:
    """A list of Trainer rows as a map-style dataset (the Trainer needs __len__ and __getitem__)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def run_hf(kind: str, steps: int, micro: int, accum: int, source: str, cache_dir: str, arch: dict,
           bf16: bool = False, vocab: int = VOCAB) -> dict:
    import torch
    from transformers import (AutoModelForCausalLM, CONFIG_MAPPING, Trainer, TrainerCallback, TrainingArguments,
                              default_data_collator)

    torch.set_num_threads(physical_cores())  # the same threads cputrain's `auto` gives one rank
    tok = shared_tokenizer(source, cache_dir, vocab)
    docs = corpus_documents(source)
    if kind == "hf-padded":
        # The recipe: tokenizer(text, padding="max_length", truncation=True, max_length=512), labels = input
        # ids with padding masked out. One record (paragraph) per example.
        enc = tok(docs, padding="max_length", truncation=True, max_length=PAD_TO, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        rows = [{"input_ids": i, "attention_mask": m, "labels": l}
                for i, m, l in zip(enc["input_ids"], enc["attention_mask"], labels)]
    else:
        rows = packed_rows(tok, docs, SEQ_LEN)

    useful = [0]

    class CountingTrainer(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            useful[0] += int(inputs["attention_mask"].sum())  # non-padding tokens only
            return super().training_step(model, inputs, num_items_in_batch)

    marks: list[tuple[float, int]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            marks.append((time.perf_counter(), useful[0]))

    config = CONFIG_MAPPING[arch["model_type"]](**{k: v for k, v in arch.items() if k != "model_type"},
                                                vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
            learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=WARMUP, weight_decay=0.1,
            adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, seed=SEED, use_cpu=True, bf16=bf16,
            report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = CountingTrainer(model=model, args=args, train_dataset=RowsDataset(rows), data_collator=default_data_collator,
                                 callbacks=[Clock()])
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    # Steady state: from the end of the first step (allocation, warm-up) to the end of the last.
    (t_first, tok_first), (t_last, tok_last) = marks[0], marks[-1]
    return {"tokens_per_s": (tok_last - tok_first) / (t_last - t_first), "wall_s": wall, "steps": len(marks),
            "useful_tokens_per_step": (tok_last - tok_first) / max(1, len(marks) - 1)}


# ------------------------------------------------------------------------------------------
# cputrain through its real code path.


def arch_overrides(arch: dict) -> list[str]:
    return [f"model.arch.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in arch.items()]


def run_cputrain(steps: int, micro: int, global_batch: int, source: str, cache_dir: str, arch: dict,
                 extra: tuple[str, ...] = (), precision: str = "fp32", vocab: int = VOCAB) -> dict:
    with tempfile.TemporaryDirectory() as out:
        args = [sys.executable, "-m", "cputrain", "train", f"output_dir={out}/run", f"data.cache_dir={cache_dir}",
                f"data.source={source}", f"data.seq_len={SEQ_LEN}", f"model.tokenizer_vocab_size={vocab}",
                *arch_overrides(arch), f"train.max_steps={steps}", f"train.global_batch_size={global_batch}",
                f"train.micro_batch_size={micro}", f"train.lr={LR}", f"train.warmup_steps={WARMUP}",
                "train.log_every=1", f"train.eval_every={steps}", "train.eval_batches=1",
                f"train.checkpoint_every={steps}", "train.sample_tokens=0", f"hardware.precision={precision}",
                f"seed={SEED}", *extra]
        proc = subprocess.run(args, capture_output=True, text=True, env=env(), cwd=REPO)
        if proc.returncode:
            raise RuntimeError(f"cputrain failed:\n{proc.stderr[-3000:]}")
        summary = json.loads((Path(out) / "run" / "summary.json").read_text())
        import yaml

        # The malloc the run chose (hardware.allocator=auto: tcmalloc where installed, else glibc).
        allocator = yaml.safe_load((Path(out) / "run" / "config.yaml").read_text())["hardware"]["allocator"]
    # summary.json: the median of the logged windows after the first (the same steady state as above).
    return {"tokens_per_s": summary["tokens_per_s"], "mfu": summary["mfu"], "wall_s": summary["wall_time_s"],
            "mfu_of_measured_peak": summary.get("mfu_of_measured_peak"),
            "measured_peak_flops": summary.get("measured_peak_flops"), "peak_flops": summary.get("peak_flops"),
            "attn_implementation": summary.get("attn_implementation"), "compile": summary.get("compile"),
            "flops_per_token": summary["flops_per_token"], "parameters": summary["parameters"],
            "allocator": allocator}


# ------------------------------------------------------------------------------------------
# The machine's measured matmul rate, in the precision of the rows it is set against.


def matmul_rate(n: int, repeats: int, dtype: str = "float32") -> float:
    """FLOP/s of an n × n × n torch.mm, timed as the ceiling times each of its products."""
    import torch

    from benchmarks.vs_hf_trainer.step_ceiling import one_gemm_s

    torch.set_num_threads(physical_cores())
    return 2 * n**3 / one_gemm_s(n, n, n, getattr(torch, dtype), repeats)


# ------------------------------------------------------------------------------------------
# The default run: command to first step (tokenizer cached), and the full run from a cold cache.


def default_run(extra: list[str], cache_dir: str) -> dict:
    """Start `cputrain train` as a user would; note when the first step's log line appears."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "cputrain", "train", f"output_dir={out}/run", f"data.cache_dir={cache_dir}",
               "train.log_every=1", *extra]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env(), cwd=REPO)
        first_step_s, tail = None, []
        for line in proc.stderr:
            tail = (tail + [line])[-30:]
            if first_step_s is None and re.search(r"\bstep 1/\d+", line):
                first_step_s = time.perf_counter() - t0
        proc.wait()
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError("default run failed:\n" + "".join(tail))
        summary = json.loads((Path(out) / "run" / "summary.json").read_text())
    return {"first_step_s": first_step_s, "wall_s": wall, "first_val_loss": summary["first_val_loss"],
            "val_loss": summary["val_loss"]}


# ------------------------------------------------------------------------------------------


def run_ceiling(micro: int, global_batch: int, source: str, cache_dir: str, arch: dict, precision: str,
                vocab: int = VOCAB) -> dict:
    from benchmarks.vs_hf_trainer.step_ceiling import step_ceiling

    # the model's vocabulary is the tokenizer's length, as run_hf builds it
    vocab_size = len(shared_tokenizer(source, cache_dir, vocab))
    return step_ceiling(arch, vocab_size, micro, global_batch, SEQ_LEN, precision, threads=physical_cores())


def child(kind: str, opts: dict) -> dict:
    if kind in ("hf-padded", "hf-packed"):
        return run_hf(kind, **opts)
    if kind == "ceiling":
        return run_ceiling(**opts)
    if kind == "matmul":
        return {"flops": matmul_rate(**opts)}
    raise ValueError(kind)


def in_fresh_process(kind: str, **opts) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(opts)], capture_output=True,
                          text=True, env=env(), cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def med(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results)


def spread(results: list[dict], key: str = "tokens_per_s") -> str:
    return f"{min(r[key] for r in results):,.0f}–{max(r[key] for r in results):,.0f}"


def block_name(precisions: list[str]) -> str:
    """fp32 blocks per kernel level (an AVX-512 run must not replace the AVX2 machine's block; the
    AVX2 one keeps the plain name), bf16-only runs per precision, and a run whose torch kernels were
    held back by ATEN_CPU_CAPABILITY apart from the machines that have that level natively."""
    import torch

    name = "vs_hf_trainer"
    capability = torch.backends.cpu.get_cpu_capability()  # what ATen dispatches to: AVX2, AVX512, ...
    if "fp32" not in precisions:
        name += "-" + "-".join(precisions)
    elif capability != "AVX2":
        name += "-" + "-".join(precisions) + "-" + capability.lower()
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        name += "-aten-" + os.environ["ATEN_CPU_CAPABILITY"].lower()
    return name


def block_heading(precisions: list[str]) -> str:
    """The block's heading under the page's one "cputrain vs the Hugging Face Trainer" section: what sets
    its table apart from the others there, the precision and the instructions it ran on (what block_name
    keys on, and for bf16 the unit that runs it: AMX or AVX512-BF16)."""
    import torch

    from cputrain.hardware import detect

    flags = detect().flags
    capability = torch.backends.cpu.get_cpu_capability()  # AVX2, AVX512, ...: what ATen dispatches to
    fp32_unit = {"AVX512": "AVX-512"}.get(capability, capability)
    bf16_unit = ("AMX" if flags.get("amx_bf16") else "AVX512-BF16 (no AMX)" if flags.get("avx512_bf16")
                 else "emulated")
    heading = "### " + " and ".join(f"{p} on {fp32_unit if p == 'fp32' else bf16_unit}" for p in precisions)
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        heading += f", torch's kernels limited by ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']}"
    return heading


def native_precisions() -> list[str]:
    """fp32 everywhere; bf16 only where the CPU runs it in hardware (emulated bf16 is 100× slower)."""
    from cputrain.hardware import detect

    return ["fp32", "bf16"] if detect().has_fast_bf16 else ["fp32"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, one repetition, print only")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per demo-size run (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions per configuration (default: %(default)s)")
    ap.add_argument("--micro-batch", type=int, default=4, help="cputrain / hf-packed micro-batch (default: %(default)s)")
    ap.add_argument("--global-batch", type=int, default=8, help="cputrain / hf-packed sequences per step (default: %(default)s)")
    ap.add_argument("--sizes", default="demo,~30M,~100M", help="comma-separated subset of demo, ~30M, ~100M")
    ap.add_argument("--precisions", default=None, help="comma-separated; default: fp32, and bf16 where the CPU "
                    "has AMX or AVX512-BF16")
    ap.add_argument("--source", default=None, help="corpus (default: ../shared/data/tinyshakespeare.txt if present, "
                    "else builtin:pydoc)")
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench"), help="tokenizer/data cache")
    ap.add_argument("--write-doc", action="store_true", help="write docs/benchmarks/vs-hf-trainer.md even with --quick")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], json.loads(a.child[1]))))
        return

    shakespeare = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
    source = a.source or (str(shakespeare) if shakespeare.is_file() else "builtin:pydoc")
    repeats = 1 if a.quick else a.repeats
    micro, global_batch = a.micro_batch, a.global_batch
    precisions = a.precisions.split(",") if a.precisions else native_precisions()
    # (name, arch, vocabulary, optimizer steps): larger models take fewer steps, each much longer.
    sizes = [("demo", ARCH, VOCAB, 4 if a.quick else a.steps)]
    if not a.quick:
        sizes += [("~30M", ARCH_30M, VOCAB, max(6, a.steps // 3)), ("~100M", ARCH_100M, VOCAB_100M, max(4, a.steps // 5))]
        sizes = [size for size in sizes if size[0] in a.sizes.split(",")]
    for _, _, vocab, _ in sizes:
        shared_tokenizer(source, a.cache_dir, vocab)  # trained once here, read from the cache by every run

    # results[(precision, size, side)] → runs; every configuration once per repetition, interleaved,
    # so a slow spell of the machine hits every one of them.
    results: dict[tuple[str, str, str], list[dict]] = {}
    for rep in range(repeats):
        print(f"repetition {rep + 1}/{repeats}", file=sys.stderr)
        for precision in precisions:
            bf16 = precision == "bf16"
            for name, arch, vocab, steps in sizes:
                common = dict(steps=steps, source=source, cache_dir=a.cache_dir, arch=arch, bf16=bf16, vocab=vocab)
                if name == "demo":
                    results.setdefault((precision, name, "hf-padded"), []).append(
                        in_fresh_process("hf-padded", micro=1, accum=4, **common))
                results.setdefault((precision, name, "hf-packed"), []).append(
                    in_fresh_process("hf-packed", micro=micro, accum=global_batch // micro, **common))
                results.setdefault((precision, name, "cputrain"), []).append(
                    run_cputrain(steps, micro, global_batch, source, a.cache_dir, arch, precision=precision, vocab=vocab))
                ceiling = in_fresh_process("ceiling", micro=micro, global_batch=global_batch, source=source,
                                           cache_dir=a.cache_dir, arch=arch, precision=precision, vocab=vocab)
                if not ceiling["gemm_flops_are_6n"]:
                    raise RuntimeError(f"{precision} {name}: the ceiling's products add up to "
                                       f"{ceiling['gemm_flops_per_step']:,} FLOPs a step, not the model's 6·N·tokens "
                                       f"{ceiling['six_n_flops_per_step']:,}")
                results.setdefault((precision, name, "ceiling"), []).append(
                    {**ceiling, "tokens_per_s": ceiling["ceiling_tokens_per_s"]})
                print(f"  {precision} {name}: " + "  ".join(
                    f"{side} {runs[-1]['tokens_per_s']:,.0f}" for (p, n, side), runs in results.items()
                    if (p, n) == (precision, name)), file=sys.stderr)

    n_mm = 1024 if a.quick else 4096
    # MFU is read in the first precision measured (fp32 when it is there), against its own matmul rate
    mfu_precision = precisions[0]
    rate = statistics.median(in_fresh_process("matmul", n=n_mm, repeats=5, dtype=DTYPES[mfu_precision])["flops"]
                             for _ in range(repeats))
    mid = results.get((mfu_precision, "~30M", "cputrain")) or results[(mfu_precision, "demo", "cputrain")]
    mid_mfu_measured = med(mid, "tokens_per_s") * mid[0]["flops_per_token"] / rate

    default_cache = tempfile.mkdtemp(prefix="cputrain-default-cache-")
    quick_default = ["train.max_steps=3", "train.eval_every=3", "train.checkpoint_every=3", "train.sample_tokens=5"]
    cold = default_run(quick_default if a.quick else [], default_cache)  # fresh cache: trains the tokenizer
    warm = [default_run(quick_default, default_cache) for _ in range(repeats)]  # tokenizer cached
    first_step = statistics.median(w["first_step_s"] for w in warm)

    rows, ratios, ceiling_ratios = [], [], []
    for precision in precisions:
        for name, arch, vocab, steps in sizes:
            cp, pk = results[(precision, name, "cputrain")], results[(precision, name, "hf-packed")]
            ratio = med(cp, "tokens_per_s") / med(pk, "tokens_per_s")
            ratios.append((precision, name, ratio))
            ce = results[(precision, name, "ceiling")]
            ceiling_ratio = med(ce, "tokens_per_s") / med(pk, "tokens_per_s")
            ceiling_ratios.append((precision, name, ceiling_ratio, med(ce, "gemm_gflops_per_s")))
            shape = (f"{name}: {cp[0]['parameters'] / 1e6:.0f}M parameters, {arch['hidden_size']} × "
                     f"{arch['num_hidden_layers']}, vocabulary {vocab:,}, {steps} steps")
            if (precision, name, "hf-padded") in results:
                pd = results[(precision, name, "hf-padded")]
                rows.append(f"| {precision} | {shape} | Trainer (a): records padded to {PAD_TO}, batch 1 × accumulation 4 "
                            f"| {med(pd, 'tokens_per_s'):,.0f} ({spread(pd)}) | "
                            f"{med(cp, 'tokens_per_s') / med(pd, 'tokens_per_s'):.1f}× (target ≥ 5×) |")
            rows.append(f"| {precision} | {shape} | Trainer (b): packed {SEQ_LEN}-token blocks (run_clm) | "
                        f"{med(pk, 'tokens_per_s'):,.0f} ({spread(pk)}) | {ratio:.2f}× (target ≥ 1.0×) |")
            rows.append(f"| {precision} | {shape} | `cputrain train` (attention {cp[-1]['attn_implementation']}, "
                        f"compile {cp[-1]['compile']}, malloc {cp[-1]['allocator']}) | {med(cp, 'tokens_per_s'):,.0f} ({spread(cp)}) | 1.00× |")
            rows.append(f"| {precision} | {shape} | ceiling: the step's matmuls and attention alone, timed in isolation "
                        f"(no norms, activations, loss, optimizer, allocator) | {med(ce, 'tokens_per_s'):,.0f} ({spread(ce)}) "
                        f"| at most {ceiling_ratio:.2f}× the Trainer |")
    met = [f"{p} {n} {r:.2f}×" for p, n, r in ratios]
    bounds = []
    for precision in precisions:
        target = SPEEDUP_TARGET[precision]
        at = [(n, r, gflops) for p, n, r, gflops in ceiling_ratios if p == precision]
        short = [n for n, r, _ in at if r < target]
        per_size = [f"{r:.2f}×{' the Trainer' if i == 0 else ''} at {n}" for i, (n, r, _) in enumerate(at)]
        bounds.append(
            f"{precision}: the ceiling is " + ", ".join(per_size)
            + " (its matmuls at " + ", ".join(f"{gflops:,.0f}" for *_, gflops in at) + f" GFLOP/s), so {target}× is "
            + (f"out of reach at {', '.join(short)} on this machine's matmul rate." if short
               else "not ruled out by the matmul rate at any size measured."))
    missing = "" if "bf16" in precisions else (
        " bf16 is not measured here: this CPU has neither AMX nor AVX512-BF16, so bf16 would be emulated; its rows "
        "come from a run on such a machine.")
    from benchmarks.runner.blocks import write_block
    from benchmarks.runner.machine import machine_line

    table = f"""{block_heading(precisions)}

{machine_line()}

Same model (transformers' Llama, built from the same config with the same seed), corpus (`{Path(source).name if not source.startswith('builtin:') else source}`),
tokenizer, batch ({global_batch} × {SEQ_LEN} tokens a step, micro-batch {micro}) and threads ({physical_cores()}); each side in
a fresh process, alternated, median of {repeats} (range in brackets). Useful tokens/s counts non-padding tokens only, from
the end of the first step to the end of the last.{missing}

| precision | model | configuration | useful tokens/s | cputrain is |
| --- | --- | --- | ---: | ---: |
{chr(10).join(rows)}

| measure | value | target |
| --- | ---: | --- |
| {mfu_precision} `torch.mm` {n_mm}² (measured peak) | {rate / 1e9:,.1f} GFLOP/s | |
| `cputrain train` at {mid[0]['parameters'] / 1e6:.1f}M parameters, {mfu_precision}: MFU against that rate (6·N + 12·L·d·T FLOPs/token) | {mid_mfu_measured:.1%} | ≥ 60% |
| the same against the theoretical peak (`cputrain doctor`) | {med(mid, 'mfu'):.1%} | |
| default run: command to first training step, tokenizer cached | {first_step:.1f} s | < 15 s |
| default run `cputrain train`, fresh cache (tokenizer trained) | {cold['wall_s']:.0f} s, validation loss {cold['first_val_loss']:.2f} → {cold['val_loss']:.2f} | ≤ 180 s, loss falls |

cputrain against the packed Trainer: {", ".join(met)} (target ≥ 1.0× each; {"met" if all(r >= 1.0 for *_, r in ratios) else "not met"}).

The ceiling against the speed-up targets (≥ {SPEEDUP_TARGET['bf16']}× the packed Trainer in bf16, ≥ {SPEEDUP_TARGET['fp32']}× in fp32, at every
size); its products add up to 6 FLOPs a token per non-embedding matrix parameter of transformers' model, lm_head
included (checked each run).
{chr(10).join(bounds)}

Reproduce: `python benchmarks/vs_hf_trainer/vs_hf_trainer.py {" ".join(sys.argv[1:])}`
(needs `scripts/install.sh bench` for the Trainer's `accelerate`).
"""
    print(table)
    if not a.quick or a.write_doc:
        write_block(block_name(precisions), table)
        print(f"written to docs/benchmarks/vs-hf-trainer.md (block {block_name(precisions)})", file=sys.stderr)


if __name__ == "__main__":
    main()
