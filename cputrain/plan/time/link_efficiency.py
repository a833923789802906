"""The share of a link's line rate gloo's collectives reach, by collective and message size.

Measured, never typed in: benchmarks/gloo_link.py runs gloo's all-gather, reduce-scatter and
all-reduce between two network namespaces joined by a veth pair, shaped by tc to a line rate and
unshaped, and writes cputrain/plan/time/gloo_link_efficiency.json:

    {"machine": str, "measured": "YYYY-MM-DD",
     "rows": [{"collective": "all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all",
               "link_gbit_s": float, "message_bytes": int, "efficiency": float}],
     "cpu_cap_rows": [{"collective": ..., "message_bytes": int, "gbit_s": float}]}   (optional)

Two limits were measured, and the lower one holds. On a slow link gloo reaches a share of the
line rate set by its protocol (the efficiency at the lowest measured rate: its reduce-scatter is
an all-reduce whose result is sliced, ~45% of the rate in the ring's bytes). On a fast one the CPU
that runs gloo's transfers and reductions is the limit: the Gbit/s it reached unshaped (the
cap rows), whatever the link. On the measuring machine this pair of figures gave the measured
efficiency at the other rates (10 and 25 Gbit/s) within its noise (block gloo_link of
docs/benchmarks/network.md). Without cap rows, the rows of the nearest measured rate answer. Sizes
between measured ones are interpolated in log(message size), clamped outside them. Without
the file the plan assumes the line rate (efficiency 1.0) and says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from cputrain.errors import ConfigError

TABLE_FILE = Path(__file__).with_name("gloo_link_efficiency.json")
# all_to_all: the all-to-all reduce-scatter (parallel.reduce_scatter); until the table has its rows,
# the time plan takes the all-gather's and says so (cputrain.plan.time.step_time.table_row_of)
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
NOT_MEASURED = "gloo's efficiency not measured: the line rate is assumed"


@dataclass(frozen=True)
class EfficiencyRow:
    collective: str
    link_gbit_s: float
    message_bytes: int
    efficiency: float


@dataclass(frozen=True)
class CpuCapRow:
    """What gloo reached with the link unshaped: the CPU's limit, in Gbit/s of the ring's bytes."""

    collective: str
    message_bytes: int
    gbit_s: float


def _interpolate(points: list[tuple[int, float]], size: float) -> float:
    """y at `size` between sorted (size, y) points, linear in log(size), clamped outside them."""
    size = max(size, 1.0)
    if size <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in pairwise(points):
        if x0 <= size <= x1:
            t = (math.log(size) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
            return y0 + t * (y1 - y0)
    return points[-1][1]


@dataclass(frozen=True)
class EfficiencyTable:
    machine: str
    measured: str
    rows: tuple[EfficiencyRow, ...]
    cpu_caps: tuple[CpuCapRow, ...] = ()

    def describe(self, cpu_capped: bool = True) -> str:
        machine = self.machine.split(",")[0]  # the CPU's name; the whole line is in the file
        where = f"gloo's efficiency measured on {machine} ({self.measured})"
        if not self.cpu_caps:
            return where
        if cpu_capped:
            return f"{where}: the link's share, capped by what gloo reached there unshaped"
        largest = max(c.message_bytes for c in self.cpu_caps)
        largest_caps = sorted((c for c in self.cpu_caps if c.message_bytes == largest),
                              key=lambda c: COLLECTIVES.index(c.collective))
        caps = "/".join(f"{c.gbit_s:.1f}" for c in largest_caps)
        names = "/".join(c.collective.replace("_", "-") for c in largest_caps)
        return (f"{where}: the link's share; gloo's CPU limit on a node not measured (one {machine} core per rank: "
                f"{caps} Gbit/s {names})")

    def has_rows(self, collective: str) -> bool:
        return any(r.collective == collective for r in self.rows)

    def cpu_cap_gbit_s(self, collective: str, message_bytes: float) -> float | None:
        points = sorted((c.message_bytes, c.gbit_s) for c in self.cpu_caps if c.collective == collective)
        return _interpolate(points, message_bytes) if points else None

    def efficiency(self, collective: str, message_bytes: float, link_gbit_s: float, cpu_capped: bool = True,
                   core_share: float = 1.0) -> float:
        """`cpu_capped=False`: the protocol's share only, for a machine whose CPU limit for gloo
        is not the measuring machine's (an instance of a cluster). `core_share`: the share of one
        of its cores each rank has (ranks sharing a core each get that share of the cap)."""
        rows = [r for r in self.rows if r.collective == collective]
        if not rows:
            return 1.0  # a collective the benchmark did not measure: the line rate
        cap_gbit_s = self.cpu_cap_gbit_s(collective, message_bytes)
        if cap_gbit_s is not None and not cpu_capped:
            rate = min(r.link_gbit_s for r in rows)
            return _interpolate(sorted((r.message_bytes, r.efficiency) for r in rows if r.link_gbit_s == rate),
                                message_bytes)
        rates = {r.link_gbit_s for r in rows}
        # with a cap, the slowest rate's share is the protocol's (the CPU was not the limit there)
        rate = (min(rates) if cap_gbit_s is not None
                else min(rates, key=lambda g: (abs(math.log(g / link_gbit_s)), g)))
        share = _interpolate(sorted((r.message_bytes, r.efficiency) for r in rows if r.link_gbit_s == rate),
                             message_bytes)
        return share if cap_gbit_s is None else min(share, cap_gbit_s * core_share / link_gbit_s)


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
    caps = []
    for i, row in enumerate(doc.get("cpu_cap_rows") or []):
        try:
            cap = CpuCapRow(str(row["collective"]), int(row["message_bytes"]), float(row["gbit_s"]))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{where} cpu_cap_rows row {i + 1}: needs collective, message_bytes and gbit_s "
                              "(numbers)") from None
        if cap.collective not in COLLECTIVES or not (cap.message_bytes > 0 and cap.gbit_s > 0):
            raise ConfigError(f"{where} cpu_cap_rows row {i + 1}: collective one of {', '.join(COLLECTIVES)}, "
                              "message_bytes and gbit_s positive")
        caps.append(cap)
    return EfficiencyTable(str(doc.get("machine", "?")), str(doc.get("measured", "?")), tuple(rows), tuple(caps))


def load_table(path: Path = TABLE_FILE) -> EfficiencyTable | None:
    """The measured table, or None where the benchmark has not written it yet."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return parse_table(doc, str(path))
