"""The plan as people read it (a table per rank) and as programs read it (plan.json)."""

from __future__ import annotations

import json

from cputrain.config import checkpointing_split
from cputrain.plan.memory.build import Plan
from cputrain.plan.memory.fit import NODE_RESERVED_FRACTION, NODE_RESERVED_GIB, POD_HEADROOM

GIB = 2**30
ROWS = (
    ("parameters", "param_bytes"),
    ("gradients", "grad_bytes"),
    ("optimizer state", "optimizer_bytes"),
    ("activations", "activation_bytes"),
    ("optimizer step temporaries", "optimizer_step_bytes"),
    ("communication buffers", "comm_buffer_bytes"),
    ("offload gradient buffers", "offload_buffer_bytes"),
    ("process overhead", "process_overhead_bytes"),
    ("training peak", "training_peak_bytes"),
    ("weights being built or loaded", "load_bytes"),
    ("loading peak", "load_peak_bytes"),
)


def _groups(plan: Plan) -> list[tuple[str, dict]]:
    """Ranks with identical rows share a column (all of them, except trailing FSDP shards)."""
    groups: list[tuple[list[int], dict]] = []
    for r in plan.ranks:
        row = {k: v for k, v in r.as_dict().items() if k != "rank"}
        if groups and groups[-1][1] == row:
            groups[-1][0].append(r.rank)
        else:
            groups.append(([r.rank], row))
    out = []
    for ranks, row in groups:
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        out.append((label, row))
    return out


def lora_summary(plan: Plan) -> dict | None:
    """What LoRA trains and how the frozen base is stored, or None for full fine-tuning."""
    m = plan.shape
    if not m.lora:
        return None
    adapters = m.adapter_inputs()
    frozen = [p for p in m.params if not p.trainable]
    return {"rank": adapters[0].shape[0] if adapters else None,
            "target_modules": sorted({a.name.split(".lora_A.")[0].rsplit(".", 1)[-1] for a in adapters}),
            "adapted_layers": len(adapters), "trainable_parameters": m.trainable_params,
            "frozen_parameters": m.frozen_params,
            # the frozen matrices' (a bf16 base under fp32 compute keeps its norms in fp32)
            "frozen_bytes_per_parameter": max((p.stored_bytes for p in frozen if len(p.shape) >= 2), default=None)}


def _lora_line(plan: Plan) -> str | None:
    lora = lora_summary(plan)
    if lora is None:
        return None
    m = plan.shape
    stored = lora["frozen_bytes_per_parameter"]
    dtype = {2: "bf16", 4: "fp32"}.get(stored, f"{stored} bytes")
    return (f"LoRA rank {lora['rank']} on {', '.join(lora['target_modules'])} ({lora['adapted_layers']} linears): "
            f"{m.trainable_params:,} trained parameters ({100 * m.trainable_params / m.total_params:.2f}%) in fp32 "
            f"with gradients and AdamW state; {m.frozen_params:,} frozen in {dtype}, parameters only"
            + (", each matrix converted to fp32 for its matmul" if stored == 2 and plan.inputs.precision == "fp32" else ""))


def checkpointing_words(setting: bool | int | str, layers: int) -> str:
    """model.activation_checkpointing as the plan's first lines say it."""
    whole, selective = checkpointing_split(setting, layers)
    if selective == layers:
        return "selective (every block keeps its matmul outputs, recomputes the rest)"
    if selective:
        return f"on {whole} of {layers} blocks whole, the other {selective} selective"
    return "on" if whole == layers else "off" if whole == 0 else f"on {whole} of {layers} blocks"


def table_lines(plan: Plan) -> list[str]:
    inp, m = plan.inputs, plan.shape
    lines = [
        f"model: {m.total_params:,} parameters, {m.layers} layers, hidden {m.hidden}, vocab {m.vocab}",
        f"strategy {inp.strategy}, precision {inp.precision}, world size {inp.world_size}, micro-batch "
        f"{inp.micro_batch} × {inp.seq_len} tokens, activation checkpointing {checkpointing_words(inp.activation_checkpointing, m.layers)}, "
        f"head + loss {'chunked' if inp.chunked_loss else 'plain'} (model.chunked_loss)",
    ]
    lora = _lora_line(plan)
    if lora:
        lines.append(lora)
    lines.append("")
    groups = _groups(plan)
    width = max(len(n) for n, _ in ROWS + (("total (peak RSS)", ""),))
    lines.append(f"{'GiB per rank':<{width}}  " + "  ".join(f"{label:>12}" for label, _ in groups))
    for name, key in ROWS + (("total (peak RSS)", "total_bytes"),):
        lines.append(f"{name:<{width}}  " + "  ".join(f"{row[key] / GIB:12.3f}" for _, row in groups))
    lines.append("(the training peak counts the larger of activations and optimizer step temporaries: they are never "
                 "alive together; the total is the larger of the training and the loading peak)")
    for note in plan.notes:
        lines.append(f"note: {note}")
    if plan.fit is not None:
        f = plan.fit
        lines += [
            "",
            f"smallest cluster that fits: {_cluster(f)}",
            f"  each pod requests {f.pod_memory_bytes / GIB:.1f} GiB (plan × {POD_HEADROOM:g}) of "
            f"{f.allocatable_gib:.1f} GiB allocatable (memory × {1 - NODE_RESERVED_FRACTION:g} − {NODE_RESERVED_GIB:g} GiB)",
        ]
    return lines


def _cluster(f) -> str:
    return (f"{f.nnodes} × {f.instance.name} ({f.instance.vcpus} vCPUs, {f.instance.memory_gib:g} GiB"
            f"{', AMX' if f.instance.amx else ''}), {f.nproc_per_node} rank(s) per node")


COMPARE_ROWS = (
    ("parameters", "param_bytes"),
    ("gradients", "grad_bytes"),
    ("optimizer state", "optimizer_bytes"),
    ("activations", "activation_bytes"),
    ("buffers, step, process", None),  # the rest of the training peak
    ("training peak", "training_peak_bytes"),
    ("loading peak", "load_peak_bytes"),
    ("total (peak RSS)", "total_bytes"),
)


def compare_lines(full: Plan, lora: Plan) -> list[str]:
    """Full fine-tuning and LoRA side by side: the peak rank of each, and where each fits."""
    columns = [("full fine-tuning", full), ("LoRA", lora)]
    width = max(len(n) for n, _ in COMPARE_ROWS + (("trained parameters", ""),))
    a, b = full.inputs, lora.inputs
    lines = [f"model: {full.shape.total_params:,} parameters; strategy {a.strategy} / {b.strategy}, world size "
             f"{a.world_size} / {b.world_size}, precision {b.precision}, micro-batch {b.micro_batch} × {b.seq_len} "
             f"tokens, activation checkpointing {checkpointing_words(b.activation_checkpointing, lora.shape.layers)}"]
    summary = _lora_line(lora)
    if summary:
        lines.append(summary)
    lines += ["", f"{'GiB per rank (peak rank)':<{width}}  " + "  ".join(f"{name:>16}" for name, _ in columns)]
    for name, key in COMPARE_ROWS:
        cells = []
        for _, plan in columns:
            row = plan.peak_rank.as_dict()
            value = row[key] if key else row["training_peak_bytes"] - sum(row[k] for _, k in COMPARE_ROWS[:4])
            cells.append(f"{value / GIB:16.3f}")
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    trained = "  ".join(f"{p.shape.trainable_params:>16,}" for _, p in columns)
    lines.append(f"{'trained parameters':<{width}}  {trained}")
    if full.fit is not None and lora.fit is not None:
        lines.append("")
        for name, plan in columns:
            lines.append(f"{name}: smallest cluster that fits: {_cluster(plan.fit)}, "
                         f"{plan.fit.pod_memory_bytes / GIB:.1f} GiB per pod")
    return lines


def plan_document(plan: Plan) -> dict:
    inp, m = plan.inputs, plan.shape
    doc = {
        "model": {"parameters": m.total_params, "layers": m.layers, "hidden_size": m.hidden,
                  "intermediate_size": m.intermediate, "num_attention_heads": m.heads,
                  "num_key_value_heads": m.kv_heads, "vocab_size": m.vocab, "tied_embeddings": m.tied_embeddings,
                  "trainable_parameters": m.trainable_params},
        "strategy": inp.strategy,
        "precision": inp.precision,
        "world_size": inp.world_size,
        "micro_batch_size": inp.micro_batch,
        "seq_len": inp.seq_len,
        "activation_checkpointing": inp.activation_checkpointing,
        "chunked_loss": inp.chunked_loss,
        "offload_optimizer": inp.offload_optimizer,
        "offload_param": inp.offload_param,
        "from_scratch": inp.from_scratch,
        "lora": lora_summary(plan),
        "ranks": [r.as_dict() for r in plan.ranks],
        "peak_rank_total_gib": plan.peak_rank.total_bytes / GIB,
        "notes": plan.notes,
    }
    if plan.fit is not None:
        f = plan.fit
        doc["cluster"] = {"instance_type": f.instance.name, "vcpus": f.instance.vcpus,
                          "memory_gib": f.instance.memory_gib, "amx": f.instance.amx, "nnodes": f.nnodes,
                          "nproc_per_node": f.nproc_per_node, "pod_memory_gib": f.pod_memory_bytes / GIB}
    return doc


def plan_json(plan: Plan) -> str:
    return json.dumps(plan_document(plan), indent=2)
