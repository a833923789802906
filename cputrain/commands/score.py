"""`cputrain score RUN --data FILE [--out FILE]`: a reward model's score of each record of a
file, one JSON line a record (the record with its reward). The work is in cputrain.finished.score."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cputrain.errors import UserError


def add_parser(sub) -> argparse.ArgumentParser:
    sc = sub.add_parser("score", help="a reward model's score of each record of a .jsonl file "
                        "(train.objective=reward), written as JSONL")
    sc.add_argument("path", help="run folder of a reward model (its model/ is used) or its model folder")
    sc.add_argument("--data", required=True, metavar="FILE", help=".jsonl records: prompt + completion (reward), "
                    "chosen + rejected with or without a prompt (reward_chosen, reward_rejected), messages or text")
    sc.add_argument("--out", metavar="FILE", help="write the scored records here (default: standard output)")
    sc.add_argument("--batch-size", type=int, default=8, help="records per forward (default: %(default)s)")
    return sc


def run(args) -> int:
    from cputrain.config.file import load_config
    from cputrain.finished.out_file import check_out_file, written_whole
    from cputrain.finished.score import score_file

    if args.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    if args.out is not None:
        check_out_file(Path(args.out), "--out")  # before the scoring, not after it
    run_config = Path(args.path) / "config.yaml"
    # the run's field names, chat template and precision; a model folder alone: the defaults
    cfg = load_config(str(run_config) if run_config.is_file() else None, [])
    bf16 = cfg.hardware.precision == "bf16"
    if args.out is None:
        score_file(args.path, Path(args.data), sys.stdout, cfg.data, bf16, args.batch_size,
                   cfg.model.trust_remote_code)
        return 0
    out = Path(args.out)
    with written_whole(out) as f:
        scored = score_file(args.path, Path(args.data), f, cfg.data, bf16, args.batch_size, cfg.model.trust_remote_code)
    print(f"scored {scored} record(s) into {out}", file=sys.stderr)
    return 0
