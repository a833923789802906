"""What fraction of the machine an 8B fine-tune reaches: Llama-3-8B's decoder layers and its
128,256-token head, at their real shapes, timed on this machine. Writes block layer_mfu.

    python benchmarks/step_time/layer_mfu.py            # the figures (≈ 10 min on 2 cores, ≈ 10 GiB peak)
    python benchmarks/step_time/layer_mfu.py --quick    # a narrow layer: checks the script only

Decoder layers (d=4096, ffn 14,336, 32 heads, 8 KV heads, RoPE θ=500,000) at seq_len 2,048,
micro-batch 1: forward + backward + clipping + fused AdamW on the layers' fp32 master weights, the
step cputrain runs (bf16 autocast, attention kernel timed on the shape, blocks compiled or not).
One and two layers, to show the per-layer cost is additive. The head: final norm, the
128,256 × 4,096 projection and the cross-entropy, plain (transformers' logits + loss) and
chunked (cputrain's default), with its optimizer step. MFU counts 6·N + 12·d·T FLOPs per token
per layer and 6·V·d for the head, against the theoretical peak (`cputrain doctor`) and the
measured matmul peak. The projection multiplies the per-token cost of 32 layers and the head;
it assumes the per-core rate holds on a larger node (memory bandwidth per core is similar on
these servers, but this is a projection, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.processes import run_child  # noqa: E402
from benchmarks.runner.timing import time_steps  # noqa: E402
from benchmarks.runner.machine import physical_cores  # noqa: E402

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "rope_theta": 500000.0, "vocab_size": 128256, "num_hidden_layers": 32, "max_position_embeddings": 8192}
QUICK = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 8192}
SEQ_LEN = 2048
NODE_CORES = 96  # a 2-socket 4th/5th-gen Xeon node, e.g. m7i.48xlarge / r7i.48xlarge (192 vCPUs)
NODES = 4


def _config(shape: dict, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(**{**shape, "num_hidden_layers": layers})


def layers_child(opts: dict) -> dict:
    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from cputrain.kernels.attention_choice import attention_choice
    from cputrain.model import compile_blocks

    torch.set_num_threads(physical_cores())
    cfg = _config(opts["shape"], opts["layers"])
    choice = attention_choice(cfg, 1, opts["seq_len"], torch.bfloat16)
    cfg._attn_implementation = choice.implementation
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(opts["layers"])])
    rotary = LlamaRotaryEmbedding(cfg)
    if opts["compile"]:
        holder = torch.nn.Module()
        holder.model = torch.nn.Module()
        holder.model.layers = layers
        compile_blocks(holder, str(REPO / ".cache" / "bench" / "inductor"))
    params = list(layers.parameters())
    step = layers_step(layers, rotary, params, opts["seq_len"], cfg.hidden_size)
    per_layer = sum(p.numel() for p in params) // opts["layers"]
    return {**time_steps(step, opts["steps"]), "params_per_layer": per_layer,
            "attn": choice.implementation, "attn_why": choice.reason}


def layers_step(layers, rotary, params: list, seq_len: int, hidden_size: int):
    """One training step of a stack of decoder layers on a random input: forward under bf16
    autocast, backward, clipping and fused AdamW over `params` (the trained ones)."""
    import torch

    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    x = torch.randn(1, seq_len, hidden_size) * 0.02
    positions = torch.arange(seq_len)[None]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x
            cos_sin = rotary(h, positions)
            for layer in layers:
                h = layer(h, position_embeddings=cos_sin, position_ids=positions)
                h = h[0] if isinstance(h, tuple) else h
            loss = h.float().square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def head_child(opts: dict) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from cputrain.kernels.chunked_head import install_chunked_loss

    torch.set_num_threads(physical_cores())
    cfg = _config(opts["shape"], 0)  # no decoder layers: embeddings, final norm and head only
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.model.embed_tokens.weight.requires_grad_(False)  # the lookup is not the head's cost
    if opts["chunked"]:
        install_chunked_loss(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    tokens = torch.randint(0, cfg.vocab_size, (1, opts["seq_len"]))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    import resource

    return {**time_steps(step, opts["steps"]), "head_params": cfg.vocab_size * cfg.hidden_size,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def fresh(kind: str, opts: dict) -> dict:
    return run_child(__file__, kind, json.dumps(opts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--comm-share", type=float, default=None,
                    help="share of a step in communication across nodes (default: the bandwidth bound below)")
    ap.add_argument("--network-gbps", type=float, default=50.0, help="per-node network for the bound (m7i.48xlarge: 50)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, opts = a.child[0], json.loads(a.child[1])
        print(json.dumps(layers_child(opts) if kind == "layers" else head_child(opts)))
        return
    import torch

    from benchmarks.runner.blocks import write_block
    from benchmarks.runner.machine import machine_line
    from cputrain.hardware import detect
    from cputrain.metrics import flops
    from cputrain.metrics.measured_peak import measured_peak_flops

    shape, seq_len, steps = (QUICK, 256, 1) if a.quick else (LLAMA3_8B, SEQ_LEN, a.steps)
    hw = detect()
    cores = physical_cores()
    peak = hw.peak_flops["bf16"]
    measured, how = measured_peak_flops(hw.cpu_model, hw.flags, cores, torch.bfloat16, remeasure=True)
    layer_rows, results, layer_mfus = [], {}, []
    for compiled in (False, True):
        for n in (1, 2):
            r = fresh("layers", {"shape": shape, "layers": n, "seq_len": seq_len, "steps": steps, "compile": compiled})
            print(n, compiled, r, file=sys.stderr)
            results[(n, compiled)] = r
            fpt = n * flops.flops_per_token(r["params_per_layer"], 1, shape["hidden_size"], seq_len)
            achieved = fpt * seq_len / r["step_s"]
            layer_mfus.append(achieved / peak)
            layer_rows.append(f"| {n} | {'compiled' if compiled else 'eager'} | {r['step_s']:.2f} | {r['step_s'] / n:.2f} | "
                              f"{achieved / 1e9:,.0f} | {achieved / peak:.1%} | {achieved / measured:.1%} | {r['first_step_s']:.0f} |")
    heads = {chunked: fresh("head", {"shape": shape, "seq_len": seq_len, "steps": steps, "chunked": chunked})
             for chunked in (False, True)}
    head_rows = []
    for chunked, r in heads.items():
        achieved = 6 * r["head_params"] * seq_len / r["step_s"]
        head_rows.append(f"| {'chunked (cputrain)' if chunked else 'plain logits + loss'} | {r['step_s']:.2f} | "
                         f"{achieved / 1e9:,.0f} | {achieved / peak:.1%} | {r['peak_rss_gib']:.1f} |")
    # projection: one token through 32 layers and the head, at the best measured per-layer time
    best = min((results[(2, c)]["step_s"] / 2 for c in (False, True)))
    best_compiled = results[(2, True)]["step_s"] / 2 < results[(2, False)]["step_s"] / 2
    layer_s_per_token = best / seq_len
    head_s_per_token = min(r["step_s"] for r in heads.values()) / seq_len
    s_per_token = shape["num_hidden_layers"] * layer_s_per_token + head_s_per_token
    machine_tps = 1 / s_per_token
    node_tps = machine_tps * NODE_CORES / cores
    params_8b = shape["num_hidden_layers"] * results[(1, False)]["params_per_layer"] + 2 * shape["vocab_size"] * shape["hidden_size"]
    full_fpt = flops.flops_per_token(params_8b - shape["vocab_size"] * shape["hidden_size"], shape["num_hidden_layers"],
                                     shape["hidden_size"], seq_len)
    step_mfu = machine_tps * full_fpt / peak
    # FSDP across nodes moves per step: all-gather bf16 weights twice (forward, backward) and
    # reduce-scatter fp32 gradients, each (N-1)/N of the model per node.
    comm_bytes = (2 * 2 + 4) * params_8b * (NODES - 1) / NODES
    tokens_per_step = NODES * 8 * seq_len  # 8 sequences of 2,048 per node per step (the recipe's batch)
    compute_s = tokens_per_step / (NODES * node_tps)
    comm_s = comm_bytes / (a.network_gbps * 1e9 / 8)
    share = a.comm_share if a.comm_share is not None else comm_s / (comm_s + compute_s)
    cluster_tps = NODES * node_tps * (1 - share)
    layer = results[(1, False)]
    text = f"""### Llama-3-8B's shapes: what fraction of the machine a fine-tune reaches

{machine_line()}

`python benchmarks/step_time/layer_mfu.py`: decoder layers of Llama-3-8B's shape (d={shape['hidden_size']}, ffn {shape['intermediate_size']:,},
{shape['num_attention_heads']} heads, {shape['num_key_value_heads']} KV heads; {layer['params_per_layer'] / 1e6:.0f}M parameters a layer) at seq_len {seq_len},
micro-batch 1, bf16 autocast with fp32 master weights, forward + backward + fused AdamW; {cores} threads; median of
{steps} steps after 2. Attention: {layer['attn_why']} → {layer['attn']}. Theoretical bf16 peak
{peak / 1e9:,.0f} GFLOP/s ({hw.peak_formula['bf16']}); measured matmul peak {measured / 1e9:,.0f} GFLOP/s ({how}).

| layers | blocks | step (s) | per layer (s) | model GFLOP/s | MFU (theoretical) | MFU (measured peak) | first step (s) |
| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(layer_rows)}

The head ({shape['vocab_size']:,} × {shape['hidden_size']} projection, final norm, cross-entropy, AdamW), 1 × {seq_len} tokens:

| head and loss | step (s) | model GFLOP/s | MFU (theoretical) | peak RSS (GiB) |
| --- | ---: | ---: | ---: | ---: |
{chr(10).join(head_rows)}

Projection for a full Llama-3-8B step ({shape['num_hidden_layers']} layers + head, {'compiled' if best_compiled else 'eager'} blocks):
{1 / s_per_token:,.1f} tokens/s on these {cores} cores, MFU {step_mfu:.1%} of the theoretical peak; ×{NODE_CORES // cores} for a
{NODE_CORES}-core node: **{node_tps:,.0f} tokens/s per node**. {NODES} nodes under FSDP ({NODES * 8} × {seq_len} tokens a step) move
{comm_bytes / 1e9:.0f} GB per node per step: {comm_s:.1f} s at {a.network_gbps:.0f} Gbit/s against {compute_s:.1f} s of compute, a
communication share of {share:.0%} if nothing overlaps: **{cluster_tps:,.0f} tokens/s per {NODES}-node cluster**
(a 10B-token pass: {1e10 / cluster_tps / 86400:.0f} days).
Target: MFU of the 8B-shaped layer ≥ 35% of the theoretical peak: {'met' if max(layer_mfus) >= 0.35 else 'not met'}
(best {max(layer_mfus):.1%}).
"""
    print(text)
    if not a.quick:
        write_block("layer_mfu", text)


if __name__ == "__main__":
    main()
