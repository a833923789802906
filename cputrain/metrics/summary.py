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
        # exp of the loss is a perplexity only where the loss is a mean per trained target: a
        # preference, feedback or reward run's summary has none
        *([("validation perplexity", fmt(s.get("val_ppl"), ".2f"))] if "val_ppl" in s or "objective" not in s else []),
        ("tokens/s (all processed)", fmt(s.get("tokens_per_s"), ",.0f")),
        ("useful tokens/s (with loss)", fmt(s.get("trained_tokens_per_s"), ",.0f")),
        ("MFU (theoretical peak)", fmt(s.get("mfu"), ".1%")),
        ("MFU (measured matmul peak)", fmt(s.get("mfu_of_measured_peak"), ".1%")),
        ("peak RSS (GiB)", fmt(s.get("peak_rss_gib"), ".2f")),
        ("wall time (s)", fmt(s.get("wall_time_s"), ".1f")),
        ("ranks × threads", f"{s.get('world_size')} × {s.get('threads_per_rank')} ({s.get('strategy')}, {s.get('precision')})"),
    ]
    if "pairs_per_s" in s:  # a preference, feedback or reward run: its batch's items (a summary before "items": pairs)
        items = s.get("items", "preference pairs")
        at = next(i for i, (k, _) in enumerate(rows) if k == "MFU (theoretical peak)")
        rows[at:at] = [(f"{items}/s", fmt(s.get("pairs_per_s"), ",.1f")),
                       (f"{items} per step", fmt(s.get("pairs_per_step"), ",.4g"))]
    if "comm_fraction" in s:
        rows.append(("time in communication", fmt(s.get("comm_fraction"), ".1%")))
    width = max(len(k) for k, _ in rows)
    return ["summary"] + [f"  {k:<{width}}  {v}" for k, v in rows]
