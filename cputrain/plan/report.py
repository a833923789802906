"""The plan as people read it (a table per rank) and as programs read it (plan.json)."""

from __future__ import annotations

import json

from cputrain.plan.build import Plan
from cputrain.plan.fit import NODE_RESERVED_FRACTION, NODE_RESERVED_GIB, POD_HEADROOM

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


def table_lines(plan: Plan) -> list[str]:
    inp, m = plan.inputs, plan.shape
    lines = [
        f"model: {m.total_params:,} parameters, {m.layers} layers, hidden {m.hidden}, vocab {m.vocab}",
        f"strategy {inp.strategy}, precision {inp.precision}, world size {inp.world_size}, micro-batch "
        f"{inp.micro_batch} × {inp.seq_len} tokens, activation checkpointing {'on' if inp.activation_checkpointing else 'off'}",
        "",
    ]
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
            f"smallest cluster that fits: {f.nnodes} × {f.instance.name} ({f.instance.vcpus} vCPUs, "
            f"{f.instance.memory_gib:g} GiB{', AMX' if f.instance.amx else ''}), {f.nproc_per_node} rank(s) per node",
            f"  each pod requests {f.pod_memory_bytes / GIB:.1f} GiB (plan × {POD_HEADROOM:g}) of "
            f"{f.allocatable_gib:.1f} GiB allocatable (memory × {1 - NODE_RESERVED_FRACTION:g} − {NODE_RESERVED_GIB:g} GiB)",
        ]
    return lines


def plan_document(plan: Plan) -> dict:
    inp, m = plan.inputs, plan.shape
    doc = {
        "model": {"parameters": m.total_params, "layers": m.layers, "hidden_size": m.hidden,
                  "intermediate_size": m.intermediate, "num_attention_heads": m.heads,
                  "num_key_value_heads": m.kv_heads, "vocab_size": m.vocab, "tied_embeddings": m.tied_embeddings},
        "strategy": inp.strategy,
        "precision": inp.precision,
        "world_size": inp.world_size,
        "micro_batch_size": inp.micro_batch,
        "seq_len": inp.seq_len,
        "activation_checkpointing": inp.activation_checkpointing,
        "offload_optimizer": inp.offload_optimizer,
        "offload_param": inp.offload_param,
        "from_scratch": inp.from_scratch,
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
