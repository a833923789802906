"""summary.json, the run's final figures, and the table printed from them: the only module
that reads or writes the file."""

from __future__ import annotations

import json

from cputrain.run_folder.layout import RunFolder
from cputrain.metrics import finite_json

NAME = "summary.json"


def read_summary(run: RunFolder) -> dict | None:
    text = run.read_text(NAME)
    return json.loads(text) if text else None


def write_summary(run: RunFolder, summary: dict) -> None:
    text = finite_json.dumps(summary, indent=2)
    run.write_text(text, NAME)


def summary_table(s: dict) -> list[str]:
    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    rows = [
        ("steps", fmt(s.get("final_step"), "d")),
        ("final train loss", fmt(s.get("final_loss"), ".4f")),
        ("validation loss", f"{fmt(s.get('first_val_loss'), '.4f')} → {fmt(s.get('val_loss'), '.4f')}"),
        ("validation perplexity", fmt(s.get("val_ppl"), ".2f")),
        ("tokens/s (all processed)", fmt(s.get("tokens_per_s"), ",.0f")),
        ("useful tokens/s (with loss)", fmt(s.get("trained_tokens_per_s"), ",.0f")),
        ("MFU (theoretical peak)", fmt(s.get("mfu"), ".1%")),
        ("MFU (measured matmul peak)", fmt(s.get("mfu_of_measured_peak"), ".1%")),
        ("peak RSS (GiB)", fmt(s.get("peak_rss_gib"), ".2f")),
        ("wall time (s)", fmt(s.get("wall_time_s"), ".1f")),
        ("ranks × threads", f"{s.get('world_size')} × {s.get('threads_per_rank')} ({s.get('strategy')}, {s.get('precision')})"),
    ]
    if "pairs_per_s" in s:  # a preference run
        rows.insert(6, ("preference pairs/s", fmt(s.get("pairs_per_s"), ",.1f")))
        rows.insert(7, ("preference pairs per step", fmt(s.get("pairs_per_step"), ",.4g")))
    if "comm_fraction" in s:
        rows.append(("time in communication", fmt(s.get("comm_fraction"), ".1%")))
    width = max(len(k) for k, _ in rows)
    return ["summary"] + [f"  {k:<{width}}  {v}" for k, v in rows]
