"""Llama-3-8B LoRA fine-tuning on this machine, end to end: block lora_8b-<precision> of docs/benchmarks/lora.md.

    python benchmarks/lora/lora_8b.py            # ~16 GB of disk for the model folder (deleted after), ~20 GiB
                                            # of memory; a step of 2,048 tokens: 5.5 min on 2 AVX512-BF16
                                            # cores, ~35 min on 2 AVX2 cores (fp32)
    python benchmarks/lora/lora_8b.py --quick    # 2 layers of the 8B shape, seq 256, 2 steps: checks the script
    python benchmarks/lora/lora_8b.py --profile-step 2   # also where step 2's time goes (train.profile_step)

The model folder has Llama-3-8B's exact config (32 layers, d 4,096, ffn 14,336, 32 heads / 8 KV
heads, vocab 128,256, untied head) and random bf16 weights in safetensors shards, as Meta's
files are laid out; its tokenizer is one cputrain trains on the corpus (a few thousand tokens:
the ids stay far below 128,256, which changes no shape). The run is `configs/llama3-8b-lora.yaml`
(LoRA r=16, alpha 32, dropout 0.05 on the seven projections, activation checkpointing, seq
2,048, micro-batch 1) on one rank, trained on chat data (builtin:pydoc-sft, the loss on the
answers, conversations packed into rows of 2,048), global batch 1, `hardware.precision=auto`:
bf16 where the CPU has AMX or AVX512-BF16, else fp32 with the base stored in bf16
(model.lora.base_dtype=auto, the files being bf16).

Reported: the time from the command to the first step; the loading peak and the training step
peak against `cputrain plan` (the run's plan.json); tokens/s and MFU against the theoretical and
the measured matmul peak; and a projection to a c7i.8xlarge (16 cores) and a 96-core node of the
same family, with its assumption named. With `--profile-step N`, step N runs under torch.profiler
(train.profile_step) and the table gains its time by operator family and the rate of its matmul
kernels (the run folder's profile_stepN.json); that step, slowed by the profiler, is left out of
the step median when another steady step is there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.base_model import shared_tokenizer  # noqa: E402
from benchmarks.runner.processes import env  # noqa: E402

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
SHARD_BYTES = 5 * 10**9  # Meta's Llama-3-8B ships four shards of ≤ 5 GB
TOKENIZER_VOCAB = 8192
GIB = 2**30
STEP_LINE = re.compile(r"step (\d+)/(\d+)")


def build_folder(folder: Path, arch: dict, cache_dir: str, seed: int = 0) -> dict:
    """A Hugging Face model folder with `arch` and random bf16 weights, written one shard at a
    time (never the whole model in memory): N(0, 0.02) matrices, norms at 1."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = shared_tokenizer("builtin:pydoc", cache_dir, TOKENIZER_VOCAB)
    config = LlamaConfig(**arch, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    config.dtype = torch.bfloat16  # what config.json says Meta's files hold
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict] = [{}]
    sizes = [0]
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if sizes[-1] and sizes[-1] + 2 * numel > SHARD_BYTES:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = shape
        sizes[-1] += 2 * numel
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in names.items():
            t = torch.empty(shape, dtype=torch.bfloat16)
            if len(shape) == 1:
                t.fill_(1.0)  # RMSNorm weights
            else:
                t.normal_(0.0, 0.02, generator=generator)
            tensors[name] = t
            weight_map[name] = file
            total += t.numel()
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 2 * total}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {"parameters": total, "shards": len(shards), "bytes": 2 * total}


def run_train(args: list[str], log_path: Path) -> dict:
    """`cputrain train` in a fresh process: its stderr to `log_path`, the time each step's line
    appeared, and the process's peak RSS (wait4's ru_maxrss)."""
    t0 = time.perf_counter()
    step_seen_s: dict[int, float] = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cputrain", "train", *args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=env(), cwd=REPO)
        for line in proc.stderr:
            log.write(line)
            log.flush()
            m = STEP_LINE.search(line)
            if m and "loss" in line:
                step_seen_s.setdefault(int(m.group(1)), time.perf_counter() - t0)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"cputrain train failed (exit {proc.returncode}):\n{tail}")
    return {"step_seen_s": step_seen_s, "process_peak_rss_gib": usage.ru_maxrss * 1024 / GIB,
            "wall_s": time.perf_counter() - t0}


def config_step_flops(run_dir: Path, seq_len: int) -> float:
    """Model FLOPs of one sequence of `seq_len` through the run's model, counted as its MFU counts
    them (cputrain.metrics.flops: no recompute of checkpointed activations)."""
    from cputrain.config.file import load_config
    from cputrain.plan.memory.build import make_plan
    from cputrain.plan.time import step_flops

    cfg = load_config(str(run_dir / "config.yaml"))
    return step_flops(make_plan(cfg, 1).shape, seq_len, 1, activation_checkpointing=False)


def projection(flops: float, mfu: float, peak_flops: float, seq_len: int, target_seq_len: int = 2048) -> list[str]:
    """The config's step (seq 2048, `flops`) here and on AMX nodes, at an assumed MFU of their peak."""
    from cputrain.plan.instances import builtin_instances
    from cputrain.plan.time import ASSUMED_CLOCK_GHZ, rank_peak_flops

    lines = []
    if seq_len != target_seq_len:
        here_s = flops / (mfu * peak_flops)
        lines += [f"This machine at seq {target_seq_len} (the config's; not run: {flops / 1e12:,.0f} TFLOP a step at "
                  f"this run's MFU, {mfu:.1%} of {peak_flops / 1e9:,.0f} GFLOP/s): ~{here_s / 60:,.0f} min a step, "
                  f"{target_seq_len / here_s:.2f} tokens/s.", ""]
    table = {i.name: i for i in builtin_instances()}
    rows = []
    for name, label in (("c7i.8xlarge", "c7i.8xlarge (16 cores)"), ("c7i.48xlarge", "96-core node (c7i.48xlarge)")):
        peak = rank_peak_flops("bf16", instance=table[name])
        for assumed, why in ((mfu, "this run's MFU"), (0.30, "30%: 60% of a measured AMX matmul peak, taken as half "
                                                               "the theoretical")):
            step_s = flops / (peak * assumed)
            rows.append(f"| {label} | {peak / 1e12:.1f} | {why} ({assumed:.1%}) | {step_s:,.1f} | {target_seq_len / step_s:,.0f} |")
    return lines + [
        f"Projection of the config's step (seq {target_seq_len}, {flops / 1e12:,.0f} TFLOP) to AMX nodes (assumption: "
        f"every core at {ASSUMED_CLOCK_GHZ} GHz on AMX bf16, at the MFU named; not measured):", "",
        "| node | bf16 peak (TFLOP/s) | MFU assumed | step (s) | tokens/s |", "| --- | ---: | --- | ---: | ---: |", *rows]


# Families of train.profile_step's summary, as the table names them.
FAMILY_ROWS = {"matmul": "matrix products", "attention": "attention kernels", "cross_entropy": "cross-entropy",
               "optimizer": "clip + optimizer", "recompute": "checkpointing's recompute", "casts_copies": "casts and copies",
               "elementwise": "elementwise", "compiled": "compiled kernels (inductor)", "collectives": "collectives",
               "other": "other operators",
               "python": "outside operators (Python)"}


def profile_rows(run_dir: Path, step: int) -> list[str]:
    """Table rows from the run's profile_step<step>.json: the step's time, its shares by operator
    family (largest first), the matmul kernels' rate."""
    profile = json.loads((run_dir / f"profile_step{step}.json").read_text())
    matmuls = profile["matmul_kernels"]
    rows = [f"| profile of step {step}: the step under torch.profiler | {profile['step_s']:,.1f} s |",
            f"| profile of step {step}: matmul kernels, FLOPs / rate | {matmuls['flops'] / 1e12:,.2f} TFLOP / "
            f"{matmuls['gflop_per_s']:,.0f} GFLOP/s |"]
    for name, figures in sorted(profile["families"].items(), key=lambda item: -item[1]["share"]):
        if figures["share"] >= 0.0005:
            rows.append(f"| profile of step {step}: {FAMILY_ROWS.get(name, name)} | {figures['share']:.1%} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers, seq 256, 2 steps; prints, writes no doc")
    ap.add_argument("--layers", type=int, default=None,
                    help="the first N decoder layers of the 8B shape (a block-level proxy that fits beside the "
                         "profiler: where a step's time goes per block, at the full sequence length)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--folder", default=None, help="model folder to build (or reuse, if it has config.json)")
    ap.add_argument("--keep-folder", action="store_true", help="keep the ~16 GB folder afterwards")
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "bench"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override on top of the config's (repeatable); the block's name carries it")
    ap.add_argument("--profile-step", type=int, default=None, metavar="N",
                    help="profile step N (train.profile_step) and add where its time went to the table")
    a = ap.parse_args()

    from benchmarks.runner.blocks import write_block_and_say
    from benchmarks.runner.machine import machine_line
    import yaml

    from cputrain.hardware import detect
    from cputrain.plan.memory.compare import compare_run

    layers = 2 if a.quick else a.layers
    arch = {**LLAMA3_8B, "num_hidden_layers": layers} if layers else LLAMA3_8B
    steps, seq_len = (2, 256) if a.quick else (a.steps, a.seq_len)
    folder = Path(a.folder or (Path(a.cache_dir) / (f"llama3-8b-shape-{layers}-layers" if layers
                                                   else "llama3-8b-random")))
    built_here = not (folder / "config.json").is_file()
    t = time.perf_counter()
    if built_here:
        made = build_folder(folder, arch, a.cache_dir)
        print(f"built {folder}: {made['parameters']:,} parameters in {made['shards']} bf16 shards "
              f"({made['bytes'] / 1e9:.1f} GB) in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    run_dir = Path(a.cache_dir) / "lora-8b-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"output_dir={run_dir}", f"model.name_or_path={folder}", "data.source=builtin:pydoc-sft",
                 "data.format=chat", f"data.seq_len={seq_len}", f"data.cache_dir={a.cache_dir}",
                 f"train.max_steps={steps}", "train.global_batch_size=1", "train.micro_batch_size=1",
                 "train.warmup_steps=1", "train.log_every=1", f"train.eval_every={10 * steps}", "train.eval_batches=1",
                 f"train.checkpoint_every={steps}", "train.sample_tokens=0", *a.set]
    if a.profile_step is not None:
        overrides.append(f"train.profile_step={a.profile_step}")
    try:
        result = run_train([str(REPO / "configs" / "llama3-8b-lora.yaml"), *overrides], run_dir.parent / "lora-8b.log")
        summary = json.loads((run_dir / "summary.json").read_text())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps_rows = [r for r in rows if "tokens_per_s" in r]
        compared = compare_run(run_dir)[0]
        plan = json.loads((run_dir / "plan.json").read_text())
        run_config = yaml.safe_load((run_dir / "config.yaml").read_text())  # the resolved settings
        target_flops = config_step_flops(run_dir, 2048)  # reads the model folder's config.json: before it goes
    finally:
        if built_here and not a.keep_folder and not a.quick:
            shutil.rmtree(folder, ignore_errors=True)
    first = steps_rows[0]
    setup_s = result["step_seen_s"][1] - first["step_time_s"]
    # the profiled step runs slower (the profiler records every operator): out of the median if it can be
    steady = [r for r in steps_rows[1:] if r["step"] != a.profile_step] or steps_rows[1:] or steps_rows
    step_s = sorted(r["step_time_s"] for r in steady)[len(steady) // 2]
    left_out = f" (step {a.profile_step}, profiled, left out)" if a.profile_step not in (None, 1) and all(
        r["step"] != a.profile_step for r in steady) else ""
    tps = seq_len / step_s
    mfu = sorted(r["mfu"] for r in steady)[len(steady) // 2]
    mfu_measured = sorted(r["mfu_of_measured_peak"] for r in steady)[len(steady) // 2]
    load_err = compared["plan_load_peak_gib"] / compared["measured_load_peak_gib"] - 1
    base_gib = plan["ranks"][0]["param_bytes"] / GIB
    losses = ", ".join(f"{r['loss']:.3f}" for r in steps_rows)
    allocator = run_config["hardware"]["allocator"]
    flags = detect().flags
    units = "AMX" if flags.get("amx_bf16") else "AVX512-BF16" if flags.get("avx512_bf16") else "no bf16 units"
    command = "python benchmarks/lora/lora_8b.py" + "".join(f" --set {o}" for o in a.set) + (" --quick" if a.quick else "") + (
        f" --profile-step {a.profile_step}" if a.profile_step is not None else "") + (
        f" --layers {layers}" if layers and not a.quick else "") + (
        f" --seq-len {seq_len}" if seq_len != 2048 and not a.quick else "") + (f" --steps {steps}" if steps != 3 and not a.quick else "")
    lines = [
        (f"### {layers} decoder layers of Llama-3-8B's shape, LoRA, {summary['precision']} ({units})" if layers
         else f"### Llama-3-8B LoRA on one machine, {summary['precision']} ({units})"),
        "",
        machine_line(),
        "",
        f"`{command}`: {__doc__.split(chr(10) + chr(10))[2].strip()}",
        "",
        f"{summary['parameters']:,} parameters, {summary['trained_parameters']:,} trained; precision "
        f"{summary['precision']}, {summary['threads_per_rank']} threads, {steps} steps of {seq_len} tokens; attention "
        f"{summary.get('attn_implementation')}, malloc {allocator}, compile {run_config['model']['compile']}, blocks "
        f"checkpointed: {run_config['model']['activation_checkpointing']}.",
        "",
        "| measure | value |",
        "| --- | ---: |",
        f"| command to first step (start, load, data, plan) | {setup_s:,.0f} s |",
        f"| first step | {first['step_time_s']:,.0f} s |",
        f"| step, median of steps 2+{left_out} | {step_s:,.0f} s |",
        f"| tokens/s | {tps:,.2f} |",
        f"| MFU, theoretical peak / measured matmul peak | {mfu:.1%} / {mfu_measured:.1%} |",
        f"| loading peak RSS, measured / plan | {compared['measured_load_peak_gib']:.2f} / "
        f"{compared['plan_load_peak_gib']:.2f} GiB ({load_err:+.1%}); the base's parameters {base_gib:.2f} GiB |",
        f"| training step peak RSS, measured / plan | {compared['measured_peak_rss_gib']:.2f} / "
        f"{compared['plan_peak_rss_gib']:.2f} GiB ({compared['rss_error']:+.1%}) |",
        f"| process peak RSS (ru_maxrss) | {result['process_peak_rss_gib']:.2f} GiB |",
        f"| losses | {losses} |",
        *(profile_rows(run_dir, a.profile_step) if a.profile_step is not None else []),
        "",
        *projection(target_flops, mfu, summary["peak_flops"], seq_len),
    ]
    markdown = "\n".join(lines)
    print(markdown)
    if not a.quick:
        # one block per precision (both are published), and per set of overrides
        write_block_and_say(f"lora_8b-{summary['precision']}" + (f"-{layers}-layers" if layers else "")
                            + "".join(f"-{o}" for o in a.set), markdown)


if __name__ == "__main__":
    main()
