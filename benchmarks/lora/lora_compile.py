"""Why compiled blocks lose with LoRA: what torch.compile makes of a decoder block carrying peft's
adapters, against the same block fully trained. Block lora_compile of docs/benchmarks/lora.md.

    python benchmarks/lora/lora_compile.py            # seconds: shapes are small, nothing is timed
    python benchmarks/lora/lora_compile.py --print    # print only

For a Llama of --layers blocks (d --hidden), built as cputrain builds it (peft's
inject_adapter_in_model through cputrain.lora.adapters, the frozen base in bf16 under bf16
autocast, fp32 otherwise) and compiled as cputrain compiles it (cputrain.model.compile_blocks:
each block's forward, regionally):

- torch._dynamo.explain of one block's forward: graphs, graph breaks and their reasons, ops in
  the graph, and guards (how many name peft's own state: its active adapter, merged flags, the
  adapter dicts);
- compiling every block and running two training steps: how many graphs dynamo made and why it
  recompiled (torch._dynamo.utils.guard_failures);
- the bytes each forward saves for its backward (every saved tensor's storage but the
  parameters', through torch.autograd.graph.saved_tensors_hooks), eager against compiled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PEFT_STATE = ("lora", "adapter", "merged", "peft", "base_layer", "use_dora", "scaling")


def build(lora: bool, precision: str, hidden: int, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cputrain.config import LoraConfig
    from cputrain.lora.adapters import add_adapters, fill_adapters

    cfg = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=int(2.75 * hidden), num_hidden_layers=layers,
                      num_attention_heads=max(hidden // 64, 2), num_key_value_heads=max(hidden // 128, 1), use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    initial = add_adapters(model, LoraConfig(enabled=True, rank=16, init_weights=False), frozen_dtype=dtype,
                           seed=0) if lora else None
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    if initial:
        fill_adapters(model, initial)
    model.train()
    return model


def saved_bytes(model, ids, precision: str) -> int:
    """Bytes of the distinct storages one forward saves for the backward, parameters left out
    (they are held anyway)."""
    import torch

    storages: dict[int, int] = {}
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in held:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(storages.values())


def measure(lora: bool, precision: str, hidden: int, layers: int, seq_len: int) -> dict:
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters, guard_failures

    from cputrain.model import compile_blocks, decoder_blocks

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    ids = torch.randint(0, 1024, (1, seq_len), generator=torch.Generator().manual_seed(0))
    model = build(lora, precision, hidden, layers)
    eager_saved = saved_bytes(model, ids, precision)

    # one block's forward, called as the model calls it: its arguments caught from an eager forward
    blocks = decoder_blocks(model)
    caught = {}
    forward = blocks[1].forward

    def catch(*args, **kwargs):
        caught["args"], caught["kwargs"] = args, kwargs
        return forward(*args, **kwargs)

    blocks[1].forward = catch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        model(input_ids=ids, labels=ids)
        blocks[1].forward = forward
        out = torch._dynamo.explain(forward)(*caught["args"], **caught["kwargs"])
    peft_guards = sum(1 for g in out.out_guards if any(k in g.name for k in PEFT_STATE))

    torch._dynamo.reset()
    counters.clear()
    guard_failures.clear()
    compile_blocks(model, str(REPO / ".cache" / "inductor-lora-compile"))
    saved_bytes(model, ids, precision)  # the first step compiles
    compiled_saved = saved_bytes(model, ids, precision)
    reasons = sorted({r.split("\n")[0].strip() for failures in guard_failures.values() for r in failures})
    return {"graphs": out.graph_count, "breaks": out.graph_break_count,
            "break_reasons": [str(b.reason) for b in out.break_reasons], "ops": out.op_count,
            "guards": len(out.out_guards), "peft_guards": peft_guards,
            "unique_graphs": counters["stats"].get("unique_graphs", 0), "recompile_reasons": reasons,
            "eager_saved_mib": eager_saved / 2**20, "compiled_saved_mib": compiled_saved / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--print", action="store_true", help="print only; write no doc")
    a = ap.parse_args()

    import torch

    from benchmarks.runner.blocks import write_block_and_say
    from benchmarks.runner.machine import machine_line

    torch.set_num_threads(min(torch.get_num_threads(), 2))
    rows, notes = [], []
    for precision in ("bf16", "fp32"):
        for lora in (False, True):
            r = measure(lora, precision, a.hidden, a.layers, a.seq_len)
            name = f"{'LoRA r=16 (frozen base ' + precision + ')' if lora else 'full fine-tuning'}, {precision}"
            rows.append(f"| {name} | {r['graphs']} | {r['breaks']} | {r['ops']} | {r['guards']} ({r['peft_guards']}) | "
                        f"{r['unique_graphs']} | {r['eager_saved_mib']:.1f} | {r['compiled_saved_mib']:.1f} "
                        f"({r['compiled_saved_mib'] / r['eager_saved_mib']:.2f}×) |")
            for reason in r["break_reasons"]:
                notes.append(f"- {name}: graph break: {reason}")
            for reason in r["recompile_reasons"]:
                notes.append(f"- {name}: recompiled: `{reason}`")
            print(rows[-1], file=sys.stderr)
    markdown = "\n".join([
        "### Compiled blocks with LoRA: what dynamo makes of them",
        "",
        machine_line(),
        "",
        f"`python benchmarks/lora/lora_compile.py`: a Llama of {a.layers} blocks, d {a.hidden}, seq {a.seq_len}, built and "
        "compiled as cputrain does (peft's adapters on the seven projections, `compile_blocks`). Nothing here is timed: "
        "graph structure and saved bytes do not depend on the CPU.",
        "",
        "| block | graphs | graph breaks | ops | guards (naming peft state) | graphs for all blocks | saved for backward, eager (MiB) | compiled (MiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        *(notes or ["- no graph break and no recompile"]),
    ])
    print(markdown)
    if not a.print:
        write_block_and_say("lora_compile", markdown)


if __name__ == "__main__":
    main()
