"""The nodes' network as a time plan takes it, and a collective's seconds through it.

A collective's bytes through a node's link take bytes ÷ (the rate its TCP flows get × gloo's share
of that rate). The rate is the node's link, or less where the flows are capped: a flow gets at most
flow_cap_gbit_s (EC2's: cputrain.plan.instances), so a node's link carries min(link, flows × cap).
gloo's share comes from a measured table (cputrain.plan.time.link_efficiency) or a given number.
On the machine the table was measured on (`gloo_cpu_capped`), gloo's transfers and reductions also
take CPU time: its bytes at the rate gloo reached there unshaped, times each rank's share of a
core. A node's own collectives cross no link and take only that CPU time (and, on another CPU
kind, whose loopback rate is not measured, are not planned).
"""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.errors import ConfigError
from cputrain.plan.time.comm_volume import Collective, CommPattern
from cputrain.plan.time.link_efficiency import NOT_MEASURED, EfficiencyTable, load_table

# gloo's native reduce-scatter sends an all-reduce's bytes, 2(W−1)/W·N, where the efficiency table
# measured it against the ring's (W−1)/W·N: per byte it sends, its share of the rate is twice the
# table's (the time is the same either way).
NATIVE_WIRE_PER_RING_BYTE = 2.0
# The all-to-all reduce-scatter has rows of its own in the table benchmarks/gloo_link.py writes; a
# table without them (one given by the user, an older one) gives it the all-gather's share (a
# collective that also sends each byte once), said "assumed".
ALL_TO_ALL_AS = "all_gather"


def table_row_of(c: Collective, table: EfficiencyTable | None = None) -> tuple[str, float]:
    """(the efficiency table's collective for `c`, the factor on its share) — see above."""
    if c.kind == "reduce_scatter" and c.via == "native":
        return "reduce_scatter", NATIVE_WIRE_PER_RING_BYTE
    if c.kind == "reduce_scatter" and c.via == "all_to_all":
        return ("all_to_all" if table is not None and table.has_rows("all_to_all") else ALL_TO_ALL_AS), 1.0
    return c.kind, 1.0


def node_link_gbit_s(link_gbit_s: float, flows: int, flow_cap_gbit_s: float | None) -> float:
    """What a collective's `flows` TCP flows get of a node's link: each flow at most the cap."""
    if flow_cap_gbit_s is None or flows <= 0:
        return link_gbit_s
    return min(link_gbit_s, flows * flow_cap_gbit_s)


@dataclass(frozen=True)
class Link:
    """What a plan is told of the nodes' network.

    `gbit_s`: each node's link; None plans no network time (one node needs none). `efficiency`:
    gloo's share of the line rate, a number for every collective or a measured table; None reads
    cputrain/plan/time/gloo_link_efficiency.json, or assumes 1.0 without it. `flow_cap_gbit_s`: what
    one TCP flow gets at most (EC2's per-flow limit; None: no cap, as on the measuring machine's
    veth), `flow_cap_source` what it is, for the plan's words. `gloo_cpu_capped`: the ranks run on
    the CPU the efficiency table was measured on (one core per rank), so gloo's collectives are also
    limited by what that CPU pushed through unshaped, and that CPU time, taken from the cores the
    compute runs on, is never hidden; `rank_core_share` is each rank's share of one core there (the
    benchmarks' 2 ranks on one core: 0.5). `overlap`: the share of network time hidden behind
    compute, 0 to 1, where a benchmark measured it (None: cputrain.plan.time.overlap's model)."""

    gbit_s: float | None = None
    efficiency: float | EfficiencyTable | None = None
    flow_cap_gbit_s: float | None = None
    flow_cap_source: str = ""
    gloo_cpu_capped: bool = False
    rank_core_share: float = 1.0
    overlap: float | None = None

    def check(self) -> None:
        if self.gbit_s is not None and not self.gbit_s > 0:
            raise ConfigError(f"--link-gbit-s must be a positive number of Gbit/s (got {self.gbit_s})")
        if self.flow_cap_gbit_s is not None and not self.flow_cap_gbit_s > 0:
            raise ConfigError(f"the per-flow cap must be a positive number of Gbit/s (got {self.flow_cap_gbit_s})")
        if not 0 < self.rank_core_share <= 1:
            raise ConfigError(f"a rank's share of a core must be in (0, 1] (got {self.rank_core_share})")
        if self.overlap is not None and not 0 <= self.overlap <= 1:
            raise ConfigError(f"overlap must be in [0, 1] (got {self.overlap})")

    def on(self, pattern: CommPattern, world: int, nnodes: int) -> LinkTimer:
        """This link under `pattern`'s collectives on `world` ranks in `nnodes` nodes."""
        if isinstance(self.efficiency, (int, float)):
            if not 0 < self.efficiency <= 1.5:
                raise ConfigError(f"efficiency must be in (0, 1.5] (got {self.efficiency})")
            return LinkTimer(self, pattern, world, nnodes, None, float(self.efficiency))
        return LinkTimer(self, pattern, world, nnodes, self.efficiency if self.efficiency is not None else load_table())


@dataclass(frozen=True)
class LinkTimer:
    """The link's arithmetic for one step's collectives: each one's rate, efficiency and seconds."""

    link: Link
    pattern: CommPattern
    world: int
    nnodes: int
    table: EfficiencyTable | None
    fixed: float = 1.0  # the given efficiency (1.0 where a table answers, or none)

    @property
    def used(self) -> bool:
        """Whether any byte crosses a node's link."""
        return self.nnodes > 1 and any(self.pattern.link_bytes(self.world, self.nnodes).values())

    @property
    def planned(self) -> bool:
        return self.used and self.link.gbit_s is not None

    def rate_gbit_s(self, c: Collective) -> float:
        if not self.planned:
            return 0.0
        return node_link_gbit_s(self.link.gbit_s, c.flows(self.world, self.nnodes), self.link.flow_cap_gbit_s)

    def efficiency(self, c: Collective) -> float:
        if self.table is None or not self.planned:
            return self.fixed
        row, factor = table_row_of(c, self.table)
        return factor * self.table.efficiency(row, c.message_bytes, self.rate_gbit_s(c), self.link.gloo_cpu_capped,
                                              self.link.rank_core_share)

    def seconds(self, c: Collective, nbytes: float | None = None) -> float:
        """`nbytes` of `c` (default: all its bytes through a node's link) at the rate the link gives it."""
        nbytes = c.link_bytes(self.world, self.nnodes) if nbytes is None else nbytes
        if not self.planned or nbytes <= 0:
            return 0.0
        return nbytes * 8 / (self.rate_gbit_s(c) * 1e9 * self.efficiency(c))

    def at_gloo_cpu_rate(self, c: Collective, nbytes: float) -> float:
        """`nbytes` of `c` at the rate gloo reached unshaped on the table's CPU, a rank holding
        rank_core_share of a core: the time gloo's transfers and reductions hold the cores."""
        row, factor = table_row_of(c, self.table)
        cap = self.table.cpu_cap_gbit_s(row, c.message_bytes)
        return nbytes * 8 / (factor * cap * self.link.rank_core_share * 1e9) if cap and nbytes > 0 else 0.0

    def cpu_seconds(self, c: Collective) -> float:
        """A collective through the link: gloo's CPU time for its bytes, where the table's CPU runs it."""
        if not (self.planned and self.link.gloo_cpu_capped and self.table):
            return 0.0
        return self.at_gloo_cpu_rate(c, c.link_bytes(self.world, self.nnodes))

    def in_node_seconds(self, c: Collective) -> float:
        """A collective that crosses no link: what one rank sends over loopback, at gloo's CPU rate
        where one was measured (on the measuring machine × each rank's share of a core there; on
        an instance at one measured core's rate per rank, which a rank of several cores may beat:
        counted, not left out, so that no layout leaning on its node's own collectives plans faster
        than one whose bytes are all counted)."""
        if c.link_bytes(self.world, self.nnodes) or not self.table:
            return 0.0
        return self.at_gloo_cpu_rate(c, c.rank_bytes(self.world, self.pattern.ranks_per_node))

    def efficiency_source(self) -> str:
        if self.table is None:
            return (f"given: {self.fixed:g} of the line rate for every collective"
                    if isinstance(self.link.efficiency, (int, float)) else NOT_MEASURED)
        said = self.table.describe(self.link.gloo_cpu_capped)
        if not self.table.has_rows("all_to_all") and any(
                c.via == "all_to_all" and c.link_bytes(self.world, self.nnodes) for c in self.pattern.collectives):
            said += "; the all-to-all reduce-scatter's share assumed: the all-gather's (not measured yet)"
        return said

    def link_source(self, single: bool) -> str:
        """What the plan says of the link; `single`: the strategy is single or the world one rank."""
        if self.used and self.link.gbit_s is None:
            return "no link given: network time not planned"
        if not self.used:
            return "single: no collectives" if single else "one node: collectives stay in memory, not network-bound"
        said = f"{self.link.gbit_s:g} Gbit/s per node"
        if self.link.flow_cap_gbit_s is not None:
            said += f", one TCP flow at most {self.link.flow_cap_gbit_s:g} ({self.link.flow_cap_source or 'given'})"
        return said

    def in_node_source(self, in_node_rank_bytes: float, in_node_s: float) -> str:
        """Where the node's own collectives' time comes from (or why there is none)."""
        said = f"{in_node_rank_bytes / 2**30:,.1f} GiB a rank per step in the node's own collectives"
        if not in_node_s:
            return said + ": not planned (no measured gloo rate)"
        if self.link.gloo_cpu_capped:
            return said + ", gloo over loopback at the CPU rate it was measured at; none hides"
        return (said + f", gloo over loopback at the rate one {self.table.machine.split(',')[0]} core reached "
                "(measured on that CPU, not on this node's); none hides")
