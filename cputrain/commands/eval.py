"""`cputrain eval PATH [CONFIG] [key=value ...]`: a finished model's validation loss and perplexity
on a dataset (a preference run: its held-out pair figures), or (--tasks) benchmark tasks through
lm-evaluation-harness. The arguments are checked here; the work is in cputrain.finished."""

from __future__ import annotations

import argparse
from pathlib import Path

from cputrain.errors import UserError


def add_parser(sub) -> argparse.ArgumentParser:
    ev = sub.add_parser("eval", help="validation loss and perplexity of a run or model on a dataset (a "
                        "preference run: held-out reward accuracy and margin), "
                        "or benchmark tasks through lm-evaluation-harness (--tasks)")
    ev.add_argument("path", help="run folder (its model/ is used) or Hugging Face model folder")
    ev.add_argument("config", nargs="?", help="YAML config whose data: section names the dataset "
                    "(default: the run's own config.yaml, else the built-in data)")
    ev.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.source=val.jsonl")
    ev.add_argument("--split", choices=["val", "train"], default="val", help="which split (default: %(default)s)")
    ev.add_argument("--max-sequences", type=int, default=64, help="evaluate at most this many sequences "
                    "(rows of packed pairs for a preference run)")
    bench = ev.add_argument_group("benchmark tasks (lm-evaluation-harness: pip install 'cputrain[eval]')")
    bench.add_argument("--tasks", metavar="NAMES", help="comma-separated harness task names, task YAML files or "
                       "folders of them; results go to RUN/eval/<task>.json (an existing one is kept: "
                       "<task>-2.json …) and are printed as a table")
    bench.add_argument("--limit", type=int, help="evaluate at most this many documents per task")
    bench.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: the task's own)")
    bench.add_argument("--batch-size", type=int, help="sequences per forward (default: the run's "
                       "train.micro_batch_size)")
    return ev


def run(args) -> int:
    from cputrain.commands.resolved_here import resolved_here
    from cputrain.finished.dataset_eval import evaluate_on_data

    if args.max_sequences < 1:
        raise UserError("--max-sequences must be at least 1")
    if args.config and "=" in args.config and not Path(args.config).exists():
        args.overrides, args.config = [args.config, *args.overrides], None  # `eval RUN key=value …`: no config named
    run_config = Path(args.path) / "config.yaml"
    config_path = args.config or (str(run_config) if run_config.is_file() else None)
    if args.tasks is not None:
        return _benchmark_tasks(args, config_path)
    given = [flag for flag, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot),
                                      ("--batch-size", args.batch_size)) if value is not None]
    if given:
        raise UserError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with --tasks (benchmark tasks); validation loss takes --max-sequences")
    cfg = resolved_here(config_path, args.overrides)
    result = evaluate_on_data(args.path, cfg, args.split, args.max_sequences, _rewards_of(cfg))
    from cputrain.metrics.finite_json import dumps

    print(dumps(result, indent=2))  # a diverged model's NaN loss is null: NaN is not JSON
    return 0


def _rewards_of(cfg):
    """Online RL: what hands the objective the run's reward functions (built here, above the
    objectives and finished models); None for every other objective."""
    from cputrain.objectives.objective import objective_class

    if not objective_class(cfg.train.objective).batches_from_rollouts:
        return None
    from cputrain.rewards.functions import build_rewards

    return lambda objective, tokenizer: objective.use_rewards(build_rewards(cfg.train, tokenizer), cfg.seed * 1000)


def _benchmark_tasks(args, config_path) -> int:
    """`eval RUN --tasks …`: the model on this machine with the run's precision and threads (its
    config.yaml; key=value overrides change them), through lm-evaluation-harness."""
    from cputrain.config.file import load_config
    from cputrain.finished import lm_harness
    from cputrain.finished.load import model_folder
    from cputrain.hardware import detect
    from cputrain.config.resolve import resolve

    for flag, value, least in (("--limit", args.limit, 1), ("--num-fewshot", args.num_fewshot, 0),
                               ("--batch-size", args.batch_size, 1)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least}")
    from cputrain.finished.load import is_reward_model

    folder = model_folder(args.path)  # a run without a model is refused first: nothing to evaluate
    if is_reward_model(folder):  # its one output is a score: the harness's tasks read next-token log-likelihoods
        raise UserError(f"the model in '{folder}' is a reward model: it scores text and has no next-token "
                        "probabilities for benchmark tasks; `cputrain eval RUN` gives its held-out pair figures, "
                        "`cputrain score` scores records")
    lm_harness.require_lm_eval()  # then a machine without the harness, before a model is loaded
    selection = lm_harness.select_tasks(args.tasks)
    # Only the machine's keys are needed (precision, threads): the data's "auto"s are not decided.
    cfg = resolve(load_config(config_path, args.overrides), detect(), world_size=1, local_world_size=1).config
    settings_from = (config_path or "this machine's defaults") + (" and key=value overrides" if args.overrides else "")
    results, written = lm_harness.evaluate_run(args.path, selection, cfg, settings_from, limit=args.limit,
                                               num_fewshot=args.num_fewshot, batch_size=args.batch_size,
                                               out_dir=Path(args.path) / "eval")
    print("\n".join(lm_harness.table_lines(results, written)))
    return 0
