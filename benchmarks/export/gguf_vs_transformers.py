"""Does llama.cpp run what `cputrain export RUN --gguf TYPE` writes as transformers runs model/?
Writes block gguf_vs_transformers of docs/benchmarks/export.md.

    python benchmarks/export/gguf_vs_transformers.py                          # runs/default and runs/demo-sft
    python benchmarks/export/gguf_vs_transformers.py RUN [RUN ...] --types f32,bf16,q8_0

Needs llama.cpp's Python binding (`pip install llama-cpp-python`, which builds llama.cpp; too heavy
for the test suite, whose tests/unit/test_gguf_export.py reads the file with the gguf package).
For each run and type the model is exported to a temporary folder (the run is not touched) and
loaded by llama.cpp; on a few prompts it is given the very token ids transformers is given, and
the next-token logits at every position are compared with transformers' fp32 forward on model/
(LoRA runs: the adapters merged). llama.cpp's own tokenizer, read from the file, must give the same
ids as the Hugging Face tokenizer on each prompt.

What must hold: f32 within 1e-4 of transformers (max |Δ logit|; both fp32, in another summation
order; llama.cpp is given an f32 KV cache, its default being f16), f16/bf16 within 0.1 of
transformers on the same weights rounded as the file stores them (llama.cpp also rounds the
activations to the weights' type before a matmul: 2^-8 of a logit of ~10 in bf16), q8_0 with the
same top-1 token at ≥ 95% of positions.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.blocks import write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402

PROMPTS = [
    "The list data type has some more methods. Here are all of the methods of list objects:",
    "A function definition defines a user-defined function object. The body of the function is",
    "Exceptions can be raised with the raise statement, and handled with try and except: if",
    "    for i, line in enumerate(lines):\n        if line.startswith('#'):\n            continue\n",
]
CHAT = [[{"role": "user", "content": "What is the assert statement in Python?"}],
        [{"role": "user", "content": "What does the with statement do?"}]]
TOLERANCE = {"f32": 1e-4, "f16": 0.1, "bf16": 0.1}
TOP1_Q8_0 = 0.95


def prompts_of(tokenizer) -> list[str]:
    """The plain prompts, and where the tokenizer has a chat template, two rendered chat prompts."""
    texts = list(PROMPTS)
    if getattr(tokenizer, "chat_template", None):
        texts += [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHAT]
    return texts


def reference_logits(model, ids: list[int], round_to=None):
    """transformers' fp32 next-token logits at every position; `round_to`: the weights rounded to
    that dtype first (the weights an f16/bf16 file holds), computed in fp32 all the same."""
    import torch

    with torch.no_grad():
        if round_to is not None:
            saved = {n: p.detach().clone() for n, p in model.named_parameters()}
            for p in model.parameters():
                p.copy_(p.to(round_to).float())
        try:
            return model(torch.tensor([ids])).logits[0].double().numpy()
        finally:
            if round_to is not None:
                for n, p in model.named_parameters():
                    p.copy_(saved[n])


def llama_cpp_logits(llm, ids: list[int]):
    import numpy as np

    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def run_label(run: Path) -> str:
    """The run's folder name and how far it trained (its summary.json), e.g. `gguf-demo (step 60, 4.2M)`."""
    import json

    summary = run / "summary.json"
    if not summary.is_file():
        return run.name
    facts = json.loads(summary.read_text())
    return f"{run.name} (step {facts.get('final_step')}, {facts.get('parameters', 0) / 1e6:.1f}M)"


def compare(run: Path, types: list[str], threads: int) -> list[dict]:
    import llama_cpp
    import numpy as np
    import torch
    from llama_cpp import Llama

    from cputrain.finished.gguf.write import export_gguf, load_source
    from cputrain.finished.load import model_folder

    folder = Path(model_folder(str(run)))
    from cputrain.data.tokenizer import load_tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(str(folder))
    state_dict, config, _ = load_source(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    model.tie_weights()
    model.eval()
    texts = prompts_of(tokenizer)
    id_lists = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    rows = []
    with tempfile.TemporaryDirectory(prefix="gguf-bench-") as tmp:
        for type_name in types:
            path = export_gguf(folder, type_name, Path(tmp) / f"model-{type_name}.gguf")
            # An f32 KV cache (llama.cpp's default is f16): what is compared is the file, not the cache.
            llm = Llama(model_path=str(path), n_ctx=1024, n_threads=threads, logits_all=True, verbose=False,
                        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
            same_ids = all(llm.tokenize(t.encode(), add_bos=False, special=True) == ids
                           for t, ids in zip(texts, id_lists))
            round_to = {"f16": torch.float16, "bf16": torch.bfloat16}.get(type_name)
            diffs, agree, positions, peak = [], 0, 0, 0.0
            for ids in id_lists:
                ref = reference_logits(model, ids, round_to)
                got = llama_cpp_logits(llm, ids)
                diffs.append(float(np.abs(got - ref).max()))
                peak = max(peak, float(np.abs(ref).max()))
                agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
                positions += len(ids)
            del llm
            max_diff, top1 = max(diffs), agree / positions
            ok = top1 >= TOP1_Q8_0 if type_name == "q8_0" else max_diff <= TOLERANCE[type_name]
            rows.append({"run": run_label(run), "type": type_name, "bytes": path.stat().st_size, "prompts": len(texts),
                         "positions": positions, "same_ids": same_ids, "max_diff": max_diff, "peak": peak,
                         "top1": top1, "ok": ok and same_ids, "chat": bool(getattr(tokenizer, "chat_template", None))})
            print(f"{run.name:<14} {type_name:<5} {path.stat().st_size / 2**20:7.2f} MiB  positions {positions:4d}  "
                  f"ids equal {same_ids!s:<5}  max |Δ logit| {max_diff:.2e} (of |logit| ≤ {peak:.1f})  "
                  f"top-1 {top1:.1%}  {'ok' if rows[-1]['ok'] else 'FAILS'}", flush=True)
    return rows


def markdown(rows: list[dict], version: str, note: str = "") -> str:
    target = {"f32": f"max Δ ≤ {TOLERANCE['f32']:g}", "f16": f"max Δ ≤ {TOLERANCE['f16']:g}",
              "bf16": f"max Δ ≤ {TOLERANCE['bf16']:g}", "q8_0": f"top-1 ≥ {TOP1_Q8_0:.0%}"}
    lines = [
        "### GGUF export: llama.cpp against transformers",
        "",
        machine_line() + f" llama.cpp through llama-cpp-python {version}, built here with -DGGML_NATIVE=ON.",
        "",
        "`cputrain export RUN --gguf TYPE`, loaded by llama.cpp; next-token logits at every position of "
        "each prompt (4 plain prompts, and the 2 chat prompts rendered with the run's template where it has one), "
        "given the same token ids as transformers' fp32 forward on `model/` (llama.cpp with an f32 KV cache). "
        "f16/bf16 are compared with transformers on the same weights rounded as the file holds them; f32 and q8_0 "
        "with the model as trained (q8_0: the demo's ffn_down matrices, rows of 688, stay f32). "
        "\"ids equal\": llama.cpp's tokenizer, read from the file, gives the Hugging Face tokenizer's ids on every prompt.",
        "",
        "| run | type | file | positions | ids equal | max \\|Δ logit\\| (largest \\|logit\\|) | top-1 agrees | target | |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['run']} | {r['type']} | {r['bytes'] / 2**20:.2f} MiB | {r['positions']} | "
                     f"{'yes' if r['same_ids'] else 'no'} | {r['max_diff']:.2e} ({r['peak']:.1f}) | {r['top1']:.1%} | "
                     f"{target[r['type']]} | {'met' if r['ok'] else 'NOT met'} |")
    if note:
        lines += ["", note]
    lines += ["", "Reproduce: `pip install llama-cpp-python` (it compiles llama.cpp), then "
              "`python benchmarks/export/gguf_vs_transformers.py runs/default runs/demo-sft`."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", default=[str(REPO / "runs" / "default"), str(REPO / "runs" / "demo-sft")])
    parser.add_argument("--types", default="f32,f16,bf16,q8_0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print the table; leave docs/benchmarks/export.md alone")
    parser.add_argument("--note", default="", help="a sentence for the block: how the runs were trained")
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp is not importable: `pip install llama-cpp-python` builds llama.cpp's Python binding",
              file=sys.stderr)
        return 1
    rows = []
    for run in args.runs:
        if not Path(run).exists():
            print(f"{run}: not there (make demo / make demo-sft train it); skipped", file=sys.stderr)
            continue
        rows += compare(Path(run), args.types.split(","), args.threads)
    if not rows:
        return 1
    if not args.no_write:
        write_block("gguf_vs_transformers", markdown(rows, llama_cpp.__version__, args.note))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
