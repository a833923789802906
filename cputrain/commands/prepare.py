"""`cputrain prepare [CONFIG] [key=value ...]`: the tokenizer and the packed token cache that
`train` with the same config and data.cache_dir reads, built ahead of it."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    prep = sub.add_parser(
        "prepare", help="tokenize and pack a config's data into data.cache_dir ahead of training",
        description="Build the tokenizer (for a model built from scratch) and the packed token cache that "
        "`train` with the same config and data.cache_dir will read. Interrupted, it resumes where it stopped.")
    prep.add_argument("config", nargs="?", help="YAML config file (optional)")
    prep.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.num_proc=8")
    return prep


def run(args) -> int:
    from cputrain.commands.resolved_here import resolved_here
    from cputrain.config.file import config_and_overrides
    from cputrain.data.prepare import prepare

    cfg = resolved_here(*config_and_overrides(args.config, args.overrides))
    from cputrain.data.feedback.kind import refuse_one_label

    _, data = prepare(cfg)
    refuse_one_label(data.stats, cfg.data)  # prepared for training: refused as train refuses it
    print(f"{data.stats['records']:,} records → {data.describe()}")
    print(f"token cache: {data.folder}")
    return 0
