"""`cputrain plan CONFIG [key=value ...]`: memory per rank and the smallest cluster that fits.

Its arguments, the config it reads and the command, which sits above cputrain.training.choices:
every key the plan reads is decided as for a run."""

from __future__ import annotations

import argparse
import json


def load_run_config(config_path: str | None, overrides: list[str]):
    """The same config `cputrain train` would read: a YAML file and dotted key=value overrides."""
    from cputrain.config.file import config_and_overrides, load_config

    return load_config(*config_and_overrides(config_path, overrides))


def world_size_of(args, cfg) -> tuple[int, int | None]:
    """(world size, ranks per node or None to let the planner choose)."""
    from cputrain.errors import ConfigError

    if args.world_size is not None:
        if args.world_size < 1:
            raise ConfigError(f"--world-size must be at least 1 (got {args.world_size})")
        if args.nnodes is not None and args.nproc_per_node is not None and args.nnodes * args.nproc_per_node != args.world_size:
            raise ConfigError(f"--world-size {args.world_size} is not --nnodes × --nproc-per-node "
                              f"({args.nnodes} × {args.nproc_per_node}); give one or the other")
        if args.nnodes is not None and args.nproc_per_node is None:  # both honoured: the ranks per node follow
            if args.nnodes < 1 or args.world_size % args.nnodes:
                raise ConfigError(f"--world-size {args.world_size} does not divide into --nnodes {args.nnodes} "
                                  "nodes of equal ranks; give --nproc-per-node instead of --world-size")
            return args.world_size, args.world_size // args.nnodes
        return args.world_size, args.nproc_per_node
    nnodes = args.nnodes if args.nnodes is not None else cfg.launch.nnodes
    nproc = args.nproc_per_node if args.nproc_per_node is not None else cfg.launch.nproc_per_node
    if nnodes < 1 or nproc < 1:
        raise ConfigError("--nnodes and --nproc-per-node must be at least 1")
    return nnodes * nproc, nproc


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="memory per rank for a model × strategy × world size, and the smallest cluster that fits",
        description="Estimate what each rank holds (parameters, gradients, optimizer state, activations, "
        "buffers) from the model's config alone (no weights), then pick the smallest cluster from an "
        "instance table. Reads the same CONFIG.yaml and key=value overrides as `cputrain train`.",
    )
    p.add_argument("config", nargs="?", help="YAML config file (optional)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.strategy=fsdp")
    p.add_argument("--world-size", type=int, help="total ranks (default: --nnodes × --nproc-per-node)")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node (default: the planner chooses)")
    p.add_argument("--nnodes", type=int, help="nodes")
    p.add_argument("--model-config", help="a config.json file (or a folder holding one) to plan for; "
                   "default: the config's model.name_or_path or model.arch")
    p.add_argument("--instances-file", help="YAML/JSON list of {name, vcpus, memory_gib, amx} (default: built-in c7i/m7i/r7i)")
    p.add_argument("--instance-type", help="plan on this instance type (default: the smallest that fits)")
    p.add_argument("--link-gbit-s", type=float, help="each node's network link in Gbit/s for the time plan "
                   "(default: the instance type's published bandwidth)")
    p.add_argument("--placement-group", action="store_true",
                   help="the nodes are in one EC2 cluster placement group: one TCP flow gets up to 10 Gbit/s "
                   "instead of 5 (default: not in one)")
    p.add_argument("--json", action="store_true", help="print plan.json instead of the table")
    p.add_argument("--compare-lora", action="store_true",
                   help="plan the config twice, full fine-tuning and model.lora (the config's rank and targets), "
                   "and print them side by side with where each fits")
    return p


def run(args) -> int:
    """Every key the plan reads decided as a run decides it (cputrain.training.choices, a plan's facts),
    then the plan: one config, or the same twice, full fine-tuning and LoRA (--compare-lora)."""
    from cputrain.plan.memory.report import compare_lines, plan_document, table_lines
    from cputrain.training.choices import decide_and_plan

    cfg = load_run_config(args.config, args.overrides)
    world_size, nproc = world_size_of(args, cfg)
    if args.world_size is None and args.nproc_per_node is None and args.nnodes is None:
        nproc = None  # nothing said about the layout: let the planner choose ranks per node
    link_gbit_s_of(args)  # a bad rate is refused before the (slower) plan
    instances = instances_of(args)
    if getattr(args, "compare_lora", False):
        if args.json:
            from cputrain.errors import ConfigError

            raise ConfigError("--compare-lora prints a table; for plan.json run once with model.lora.enabled=true "
                              "and once without")
        # The same file and overrides, then model.lora.enabled last (validated like any override:
        # LoRA needs model.name_or_path and refuses zero3); each decided on its own.
        full, lora = (decide_and_plan(load_run_config(args.config, [*args.overrides, f"model.lora.enabled={on}"]),
                                   world_size, nproc_per_node=nproc, instances=instances,
                                   config_json=args.model_config)
                      for on in ("false", "true"))
        print("\n".join(compare_lines(full, lora)))
        return 0
    plan = decide_and_plan(cfg, world_size, nproc_per_node=nproc, instances=instances, network=network_of(args),
                           config_json=args.model_config)
    time_lines, time_doc = with_time_plan(args, cfg, plan)
    if args.json:
        print(json.dumps({**plan_document(plan), **time_doc}, indent=2))
    else:
        print("\n".join(table_lines(plan) + time_lines))
    return 0


def link_gbit_s_of(args) -> float | None:
    """--link-gbit-s, refused in one line unless a positive, finite rate."""
    import math

    from cputrain.errors import ConfigError

    value = getattr(args, "link_gbit_s", None)
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--link-gbit-s must be a positive number of Gbit/s (got {value:g})")
    return value


def network_of(args):
    """What the plan assumes of the nodes' network: --link-gbit-s and --placement-group."""
    from cputrain.plan.time import Network

    return Network(link_gbit_s_of(args), bool(getattr(args, "placement_group", False)))


def instances_of(args):
    """The instance table, or only --instance-type's row of it."""
    from cputrain.plan.instances import find_instance, load_instances

    instances = load_instances(args.instances_file)
    return [find_instance(instances, args.instance_type)] if getattr(args, "instance_type", None) else instances


def with_time_plan(args, cfg, plan) -> tuple[list[str], dict]:
    """The time plan's printed lines and plan.json section for a plan fitted on an instance, and
    under fsdp every layout on every instance type of the table."""
    from cputrain.plan.instances import load_instances
    from cputrain.plan.layouts import layout_table, table_document, table_lines
    from cputrain.plan.time import time_document, time_lines, time_plan, worth_of_plan

    if plan.fit is None:
        return [], {}
    network = network_of(args)
    table = load_instances(args.instances_file)
    tp = time_plan(plan, cfg.train.global_batch_size, plan.fit.instance, plan.fit.nproc_per_node,
                   network.link_gbit_s, candidates=table, placement_group=network.placement_group)
    lines, doc = time_lines(tp), {"time": time_document(tp)}
    worth = worth_of_plan(tp.step, plan, cfg.train, tp.instance.price_per_hour)
    lines.append(f"  checkpoints      {worth.line()}")
    doc["time"]["checkpoints"] = worth.as_dict()
    if plan.inputs.strategy == "fsdp":
        per_node = plan.fit.nproc_per_node
        one_node, note = None, []
        if plan.fit.nnodes > 1:  # the same config on one node, decided as a run there would decide it
            from cputrain.training.choices import decide_and_plan

            one_cfg = _on_one_node(cfg, per_node)
            one_node = decide_and_plan(one_cfg, per_node, nproc_per_node=per_node, network=network,
                                       config_json=args.model_config)
            if one_cfg is not cfg:
                note = [f"  (parallel.layout={cfg.parallel.layout} does not run on one node: one node is planned "
                        f"with {one_node.inputs.layout}, as parallel.layout=auto decides there)"]
        rows = layout_table(plan, cfg.train.global_batch_size, table, per_node, network, one_node)
        lines += table_lines(rows, network) + note
        doc["time"]["layouts"] = table_document(rows)
    return lines, doc


def _on_one_node(cfg, per_node: int):
    """The config a single node of the plan would run: a hand-set layout that one node does not
    admit (hybrid, node_reshard) left to auto there; else `cfg` itself."""
    from cputrain.parallel.fsdp_layouts import layout_error

    layout = cfg.parallel.layout
    if layout == "auto" or layout_error(layout, per_node, per_node) is None:
        return cfg
    return cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"layout": "auto"})})
