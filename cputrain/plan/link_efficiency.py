"""The share of a link's line rate gloo's collectives reach, by collective and message size.

Measured, never typed in: a benchmark runs gloo's all-gather, reduce-scatter and all-reduce
between two network namespaces joined by a rate-limited veth pair and writes
cputrain/plan/gloo_link_efficiency.json:

    {"machine": str, "measured": "YYYY-MM-DD",
     "rows": [{"collective": "all_gather" | "reduce_scatter" | "all_reduce",
               "link_gbit_s": float, "message_bytes": int, "efficiency": float}]}

For a collective, message size and link rate the table answers with the rows of the nearest
measured rate, interpolated in log(message size) between the measured sizes and clamped
outside them. Without the file the plan assumes the line rate (efficiency 1.0) and says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from cputrain.errors import ConfigError

TABLE_FILE = Path(__file__).with_name("gloo_link_efficiency.json")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
NOT_MEASURED = "gloo's efficiency not measured: the line rate is assumed"


@dataclass(frozen=True)
class EfficiencyRow:
    collective: str
    link_gbit_s: float
    message_bytes: int
    efficiency: float


@dataclass(frozen=True)
class EfficiencyTable:
    machine: str
    measured: str
    rows: tuple[EfficiencyRow, ...]

    def describe(self) -> str:
        return f"gloo's efficiency measured on {self.machine} ({self.measured})"

    def efficiency(self, collective: str, message_bytes: float, link_gbit_s: float) -> float:
        rows = [r for r in self.rows if r.collective == collective]
        if not rows:
            return 1.0  # a collective the benchmark did not measure: the line rate
        rate = min({r.link_gbit_s for r in rows}, key=lambda g: (abs(math.log(g / link_gbit_s)), g))
        points = sorted((r.message_bytes, r.efficiency) for r in rows if r.link_gbit_s == rate)
        size = max(message_bytes, 1.0)
        if size <= points[0][0]:
            return points[0][1]
        if size >= points[-1][0]:
            return points[-1][1]
        for (x0, y0), (x1, y1) in pairwise(points):
            if x0 <= size <= x1:
                t = (math.log(size) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
                return y0 + t * (y1 - y0)
        return points[-1][1]


def parse_table(doc: object, where: str) -> EfficiencyTable:
    """The table of a JSON document, or a one-line ConfigError naming what is wrong in it."""
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or not doc["rows"]:
        raise ConfigError(f"{where}: expected {{\"machine\", \"measured\", \"rows\": [...]}} with at least one row")
    rows = []
    for i, row in enumerate(doc["rows"]):
        try:
            parsed = EfficiencyRow(str(row["collective"]), float(row["link_gbit_s"]), int(row["message_bytes"]),
                                   float(row["efficiency"]))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{where} row {i + 1}: needs collective, link_gbit_s, message_bytes and efficiency "
                              "(numbers)") from None
        if parsed.collective not in COLLECTIVES:
            raise ConfigError(f"{where} row {i + 1}: collective '{parsed.collective}' is not one of "
                              f"{', '.join(COLLECTIVES)}")
        if not (parsed.link_gbit_s > 0 and parsed.message_bytes > 0 and 0 < parsed.efficiency <= 1.5):
            raise ConfigError(f"{where} row {i + 1}: link_gbit_s and message_bytes must be positive and efficiency "
                              "in (0, 1.5]")
        rows.append(parsed)
    return EfficiencyTable(str(doc.get("machine", "?")), str(doc.get("measured", "?")), tuple(rows))


def load_table(path: Path = TABLE_FILE) -> EfficiencyTable | None:
    """The measured table, or None where the benchmark has not written it yet."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return parse_table(doc, str(path))
