"""Plan against measurement: plan.json next to memory.json of the same run folder.

The measured row is memory.json's "training step peak" phase of each rank: parameter,
gradient and optimizer bytes held at the optimizer step, and the peak RSS of the steps. The
loading peak (the "sharded weights" phase's high-water mark since the process started) is
shown beside the plan's, for reading; the training peak is the one held to the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

GIB = 2**30
EXACT = ("param_bytes", "grad_bytes", "optimizer_bytes")
RSS_TOLERANCE = 0.15


def compare_run(run_dir: str | Path) -> list[dict]:
    """One row per rank: planned and measured bytes, and the relative error of peak RSS."""
    run_dir = Path(run_dir)
    plan = json.loads((run_dir / "plan.json").read_text())
    memory = json.loads((run_dir / "memory.json").read_text())
    rows = []
    for planned, measured_rank in zip(plan["ranks"], memory["ranks"]):
        peak = next(p for p in measured_rank["phases"] if p["phase"] == "training step peak")
        loaded = next(p for p in measured_rank["phases"] if p["phase"] == "sharded weights")
        strategy = plan["strategy"] + ("+offload" if plan.get("offload_optimizer") else "")
        strategy += "+LoRA" if plan.get("lora") else ""
        strategy += f" {plan['precision']}" if plan.get("precision", "fp32") != "fp32" else ""
        row = {"rank": measured_rank["rank"], "strategy": strategy, "world_size": plan["world_size"],
               "parameters": plan["model"]["parameters"]}
        for key in EXACT:
            row[f"plan_{key}"], row[f"measured_{key}"] = planned[key], peak[key]
        row["plan_peak_rss_gib"] = planned["training_peak_bytes"] / GIB  # the phase starts after loading
        row["measured_peak_rss_gib"] = peak["rss_gib"]
        row["rss_error"] = row["plan_peak_rss_gib"] / row["measured_peak_rss_gib"] - 1
        row["plan_load_peak_gib"] = planned["load_peak_bytes"] / GIB
        row["measured_load_peak_gib"] = loaded["peak_rss_gib"]
        rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| parameters | strategy | ranks | rank | params MiB plan / measured | grads MiB plan / measured | "
             "optimizer MiB plan / measured | peak RSS GiB plan / measured | error | loading peak GiB plan / measured |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    mib = 2**20
    for r in rows:
        cells = [f"{r['parameters'] / 1e6:.1f}M", r["strategy"], str(r["world_size"]), str(r["rank"])]
        for key in EXACT:
            cells.append(f"{r[f'plan_{key}'] / mib:.2f} / {r[f'measured_{key}'] / mib:.2f}")
        cells.append(f"{r['plan_peak_rss_gib']:.3f} / {r['measured_peak_rss_gib']:.3f}")
        cells.append(f"{r['rss_error']:+.1%}")
        cells.append(f"{r['plan_load_peak_gib']:.3f} / {r['measured_load_peak_gib']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
