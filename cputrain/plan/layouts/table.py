"""Every FSDP layout on every instance type of the table, as `cputrain plan` prints it: tokens/s,
the network's share of the step, USD per million tokens, and whether the memory plan fits a node;
then, per instance type, "will these nodes beat one?": its fastest layout that fits against one
node of the same type (the same ranks per node and global batch, its layout decided as a run there
would decide it).

Each cell is the plan of cputrain.plan.layouts.choice (the layout's memory plan, its step on
that instance's link and MFU), so the table and parallel.layout=auto never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from cputrain.parallel.fsdp_layouts import LAYOUTS
from cputrain.plan.instances import Instance, flow_cap
from cputrain.plan.memory.fit import fits
from cputrain.plan.layouts.choice import LayoutFigures, fastest, figures_on_instance, plans_by_layout
from cputrain.plan.time import Network, step_on_instance

GIB = 2**30


@dataclass(frozen=True)
class InstanceRow:
    instance: Instance
    nnodes: int
    figures: list[LayoutFigures]  # each admissible layout on nnodes of the instance
    one_node: LayoutFigures | None  # the layout auto decides on one node of it (None: the plan is of one node)

    def usd_per_million_tokens(self, f: LayoutFigures, nnodes: int | None = None) -> float | None:
        if self.instance.price_per_hour is None:
            return None
        return self.instance.price_per_hour * (nnodes or self.nnodes) / 3600 / f.step.tokens_per_s * 1e6

    @property
    def best(self) -> LayoutFigures | None:
        fitting = [f for f in self.figures if f.fits]
        return fastest(fitting) if fitting else None


def layout_table(plan, global_batch: int, instances: list[Instance], ranks_per_node: int, network: Network,
                 one_node=None) -> list[InstanceRow]:
    """The rows for memory plan `plan` (fsdp; its world and inputs as decided) on each of
    `instances`, `ranks_per_node` to a node. `one_node`: the same config's plan on one node of
    `ranks_per_node` ranks, decided as a run there would decide it (None: no comparison)."""
    world = plan.inputs.world_size
    nnodes = world // ranks_per_node
    plans = plans_by_layout(plan, ranks_per_node)
    if nnodes <= 1:
        one_node = None
    rows = []
    for instance in instances:
        alone = None
        if one_node is not None:
            step, _ = step_on_instance(one_node, global_batch, instance, ranks_per_node, network)
            peak = one_node.peak_rank.total_bytes
            alone = LayoutFigures(one_node.inputs.layout, peak, fits(instance, peak, ranks_per_node), step)
        rows.append(InstanceRow(instance, nnodes, figures_on_instance(plans, global_batch, instance,
                                                                      ranks_per_node, network), alone))
    return rows


def _cell(row: InstanceRow, f: LayoutFigures | None) -> str:
    if f is None:
        return "(not on this world)"
    if not f.fits:
        return f"does not fit ({f.peak_rank_bytes / GIB:,.0f} GiB)"
    usd = row.usd_per_million_tokens(f)
    return f"{f.step.tokens_per_s:,.0f} · {f.step.network_share:.0%}" + (f" · {usd:,.2f}" if usd is not None else "")


def beat_one_node_line(row: InstanceRow) -> str:
    """"Will these nodes beat one?" for one instance type, in one line."""
    name = row.instance.name
    best = row.best
    if best is None:
        return f"{name}: no layout fits {row.nnodes} nodes of it"
    here = f"{best.layout} {best.step.tokens_per_s:,.0f} tokens/s (network {best.step.network_share:.0%} of the step)"
    alone = row.one_node
    if alone is None:
        return f"{name}: {here}"
    if not alone.fits:
        return (f"{name}: {here}; one node does not hold the state "
                f"({alone.peak_rank_bytes / GIB:,.0f} GiB a rank)")
    ratio = best.step.tokens_per_s / alone.step.tokens_per_s
    verdict = "beat" if ratio > 1 else "do not beat"
    return (f"{name}: {here}, {ratio:.2f}× one node's {alone.step.tokens_per_s:,.0f}: {row.nnodes} nodes "
            f"{verdict} 1")


def table_lines(rows: list[InstanceRow], network: Network) -> list[str]:
    if not rows:
        return []
    first = rows[0]
    world = first.figures[0].step.world_size
    per_node = world // first.nnodes
    cap, _ = flow_cap(network.placement_group)
    link = (f"{network.link_gbit_s:g} Gbit/s links" if network.link_gbit_s is not None
            else "each type's published link")
    where = ("in a cluster placement group" if network.placement_group
             else "not in a cluster placement group (--placement-group: 10)")
    lines = ["", f"FSDP layouts × instance types ({first.nnodes} nodes × {per_node} ranks, {link}, one TCP flow at "
                 f"most {cap:g} Gbit/s: {where}); each cell: tokens/s · network share of the step · USD per "
                 "million tokens, or the memory a rank needs where it does not fit a node:"]
    width = max(len(r.instance.name) for r in rows)
    cells = [[_cell(r, next((f for f in r.figures if f.layout == layout), None)) for layout in LAYOUTS]
             for r in rows]
    widths = [max(len(layout), *(len(c[i]) for c in cells)) for i, layout in enumerate(LAYOUTS)]
    lines.append((f"  {'instance':<{width}}  " + "  ".join(f"{layout:<{w}}" for layout, w in zip(LAYOUTS, widths)))
                 .rstrip())
    for r, c in zip(rows, cells):
        lines.append(f"  {r.instance.name:<{width}}  " + "  ".join(f"{x:<{w}}" for x, w in zip(c, widths)).rstrip())
    if first.nnodes > 1:
        lines.append(f"will {first.nnodes} nodes beat 1? the fastest layout that fits, against one node of the same "
                     f"type ({per_node} ranks, the same global batch):")
        lines += [f"  {beat_one_node_line(r)}" for r in rows]
    return lines


def table_document(rows: list[InstanceRow]) -> list[dict]:
    out = []
    for r in rows:
        def figures(f: LayoutFigures, nnodes: int | None = None) -> dict:
            return {"layout": f.layout, "fits": f.fits, "peak_rank_gib": f.peak_rank_bytes / GIB,
                    "tokens_per_s": f.step.tokens_per_s, "network_share": f.step.network_share,
                    "step_s": f.step.step_s, "usd_per_million_tokens": r.usd_per_million_tokens(f, nnodes)}

        best = r.best
        out.append({"instance_type": r.instance.name, "nnodes": r.nnodes,
                    "layouts": [figures(f) for f in r.figures],
                    "best": best.layout if best else None,
                    "one_node": figures(r.one_node, 1) if r.one_node else None})
    return out
