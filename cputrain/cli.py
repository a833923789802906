"""`cputrain` command line: train, prepare, doctor, generate, eval, export, plan, k8s.

Every user error ends as one line on stderr and exit code 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from cputrain.errors import UserError

log = logging.getLogger("cputrain")

EXAMPLES = """examples:
  cputrain train                                   # the built-in demo: small Llama on Python's docs
  cputrain train configs/finetune-local.yaml train.max_steps=20
  cputrain prepare configs/llama3-8b-fsdp.yaml          # tokenize into data.cache_dir ahead of a job
  cputrain doctor
  cputrain generate runs/default --prompt "The list"
  cputrain generate runs/demo-sft --chat "What is the assert statement in Python?"
  cputrain eval runs/default
  cputrain eval runs/default --tasks hellaswag,arc_easy --limit 100   # lm-evaluation-harness benchmarks
  cputrain export runs/lora --merge                # a LoRA run's adapters folded into a plain model
  cputrain export runs/default --gguf q8_0         # one GGUF file for llama.cpp and Ollama
"""


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="show full tracebacks for errors")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cputrain",
        description="Train and fine-tune Hugging Face causal language models on CPUs.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="train or fine-tune a model (resumes from the newest checkpoint in output_dir)",
        description="Train from a YAML config with dotted key=value overrides; no config runs the built-in demo. "
        "Re-running the same command resumes from the newest complete checkpoint.",
        epilog="overrides: any config key, e.g. train.max_steps=20 data.seq_len=512 hardware.precision=fp32\n"
        "           `cputrain train --help-config` lists every key with its default and meaning.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", nargs="?", help="YAML config file (optional)")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=20")
    train.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    train.add_argument("--take-over-lock", action="store_true",
                       help="take output_dir's run.lock from the run holding it (use when that run is gone)")
    # torchrun's flags; each maps onto config section `launch` (PET_* variables give their defaults).
    dist = train.add_argument_group("ranks and nodes (torchrun's flags; default from PET_* variables)")
    dist.add_argument("--nproc-per-node", type=int, help="ranks on this node, started by the torchrun agent")
    dist.add_argument("--nnodes", type=int, help="nodes taking part")
    dist.add_argument("--node-rank", type=int, help="this node's index, 0 … nnodes-1 (node 0 hosts the rendezvous)")
    dist.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous on node 0")
    dist.add_argument("--max-restarts", type=int, help="restart the ranks this many times after one dies")
    dist.add_argument("--dry-run", action="store_true", help="print each rank's threads, cores and settings; start nothing")
    _add_common(train)

    doctor = sub.add_parser("doctor", help="show the hardware, the torch build and what `auto` settings resolve to")
    doctor.add_argument("--json", action="store_true", help="print the facts as JSON")
    _add_common(doctor)

    gen = sub.add_parser("generate", help="sample text from a run folder or an exported model folder")
    gen.add_argument("path", help="run folder (its model/ is used) or Hugging Face model folder")
    gen.add_argument("--prompt", default="The", help="text to continue (default: %(default)r)")
    gen.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    gen.add_argument("--chat", metavar="MESSAGE", help="a user's message, answered in the model's chat template "
                     "(the reply stops at the end of its turn); replaces --prompt")
    _add_common(gen)

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
    _add_common(ev)

    exp = sub.add_parser(
        "export", help="write a LoRA run as a plain Hugging Face model (--merge), or any run as GGUF (--gguf TYPE)",
        description="A LoRA run exports its adapters (model/: a peft adapter folder on its base). --merge loads the "
        "base, folds the adapters into its weights and writes a plain Hugging Face model folder that transformers "
        "loads without peft. --gguf TYPE writes a run's model (a LoRA run's merged), or a Hugging Face Llama folder, "
        "with its tokenizer and chat template as one GGUF file for llama.cpp and Ollama. "
        "Nothing is overwritten: the output must not exist.")
    exp.add_argument("path", help="run folder (its model/ is used), a peft adapter folder, or (--gguf) a Hugging "
                     "Face Llama folder")
    exp.add_argument("--merge", action="store_true", help="merge the adapters into the base weights")
    exp.add_argument("--gguf", metavar="TYPE", help="write one .gguf file: f32, f16, bf16 or q8_0 (K-quants such as "
                     "q4_k_m: the llama-quantize command that makes one from the bf16 file is printed)")
    exp.add_argument("--out", help="output folder (default: <run>/model-merged) or, with --gguf, file "
                     "(default: <run>/model-TYPE.gguf)")
    _add_common(exp)

    prep = sub.add_parser(
        "prepare", help="tokenize and pack a config's data into data.cache_dir ahead of training",
        description="Build the tokenizer (for a model built from scratch) and the packed token cache that "
        "`train` with the same config and data.cache_dir will read. Interrupted, it resumes where it stopped.")
    prep.add_argument("config", nargs="?", help="YAML config file (optional)")
    prep.add_argument("overrides", nargs="*", help="key=value overrides, e.g. data.num_proc=8")
    _add_common(prep)

    from cputrain.k8s import command as k8s_command
    from cputrain.plan import command as plan_command

    plan_command.add_parser(sub, _add_common)
    k8s_command.add_parser(sub, _add_common)
    return parser


# ----------------------------------------------------------------------------------------


def _config_and_overrides(args) -> tuple[str | None, list[str]]:
    from cputrain.config.file import config_and_overrides

    return config_and_overrides(args.config, args.overrides)


def cmd_train(args) -> int:
    from cputrain.config.file import describe_fields, load_config
    if args.help_config:
        for key, default, doc in describe_fields():
            print(f"{key:<34} {default:<22} {doc}")
        return 0
    config_path, overrides = _config_and_overrides(args)
    from cputrain.distributed.agent import pet_overrides
    from cputrain.training.launch import launch

    flags = {"nproc_per_node": args.nproc_per_node, "nnodes": args.nnodes, "node_rank": args.node_rank,
             "rdzv_endpoint": args.rdzv_endpoint, "max_restarts": args.max_restarts}
    # Precedence: config file < PET_* variables < key=value overrides < flags.
    overrides = pet_overrides() + overrides + [f"launch.{k}={v}" for k, v in flags.items() if v is not None]
    cfg = load_config(config_path, overrides)
    if args.from_command_line and not args.dry_run:
        _start_again_with_allocator(cfg)
    # Ranks started by the agent re-run this same command, config and overrides included.
    worker_args = ([config_path] if config_path else []) + overrides + (["--debug"] if args.debug else []) + (
        ["--take-over-lock"] if args.take_over_lock else [])
    from cputrain.training.worker import run_worker

    summary = launch(cfg, worker_args, run_here=lambda: run_worker(cfg, take_over_lock=args.take_over_lock),
                     dry_run=args.dry_run)
    return 0 if summary is not None else 1


def _start_again_with_allocator(cfg) -> None:
    """A one-process run started from the command line starts itself again, once, with tcmalloc
    preloaded (hardware.allocator; a library can only be preloaded into a new process). Nothing
    has been read, written or imported by then; the pid stays the same (exec), so signals and
    exit codes are the caller's as before. The agent preloads its ranks itself."""
    from cputrain.native.allocator import allocator_choice, reexec_env
    from cputrain.distributed.env import started_by_launcher

    if started_by_launcher() or cfg.launch.nproc_per_node * cfg.launch.nnodes != 1:
        return
    env = reexec_env(allocator_choice(cfg.hardware.allocator), dict(os.environ))
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "cputrain", *sys.argv[1:]], env)


def cmd_doctor(args) -> int:
    from cputrain.config import Config
    from cputrain.distributed.env import normalize
    from cputrain.hardware import detect, report_lines
    from cputrain.config.resolve import resolve

    hw = detect()
    ranks = normalize(dict(os.environ))
    res = resolve(Config(), hw, world_size=ranks.world_size, local_world_size=ranks.local_world_size)
    from cputrain.metrics.measured_peak import machine_peaks

    measured = machine_peaks(hw, threads=res.config.hardware.threads)
    if args.json:
        from dataclasses import asdict

        facts = asdict(hw)
        facts["measured_peak_flops"] = {p: {"flops": f, "how": how} for p, (f, how) in measured.items()}
        facts["auto"] = {k: {"value": v, "reason": why} for k, v, why in res.reasons}
        print(json.dumps(facts, indent=2, default=str))
        return 0
    from cputrain.native.libs import report_lines as native_lib_lines

    for line in report_lines(hw) + native_lib_lines():
        print(line)
    for precision, (flops, how) in measured.items():
        share = flops / hw.peak_flops[precision]
        print(f"measured {precision:<5} {flops / 1e9:9.1f} GFLOP/s = {share:.0%} of the peak above ({how}; best seen here)")
    print("auto settings for one rank on this machine:")
    for key, value, why in res.reasons:
        print(f"  {key} = {value}: {why}")
    return 0


def cmd_generate(args) -> int:
    from cputrain.inference import generate_text

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    chat = args.chat is not None
    print(generate_text(args.path, args.chat if chat else args.prompt, args.max_new_tokens, args.temperature,
                        args.top_k, args.seed, chat=chat))
    return 0


def cmd_eval(args) -> int:
    from pathlib import Path

    from cputrain.data.prepare import prepare, rows_of
    from cputrain.evaluation import evaluate_loss
    from cputrain.inference import load_for_inference, model_folder
    from cputrain.objectives.objective import PREFERENCE_OBJECTIVES

    if args.max_sequences < 1:
        raise UserError("--max-sequences must be at least 1")
    if args.config and "=" in args.config and not Path(args.config).exists():
        args.overrides, args.config = [args.config, *args.overrides], None  # `eval RUN key=value …`: no config named
    run_config = Path(args.path) / "config.yaml"
    config_path = args.config or (str(run_config) if run_config.is_file() else None)
    if args.tasks is not None:
        return _eval_tasks(args, config_path)
    given = [flag for flag, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot),
                                      ("--batch-size", args.batch_size)) if value is not None]
    if given:
        raise UserError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with --tasks (benchmark tasks); validation loss takes --max-sequences")
    cfg = _resolved_here(config_path, args.overrides)
    preference = cfg.train.objective in PREFERENCE_OBJECTIVES
    if preference:  # the models are loaded by evaluate_pairs, one after the other
        from cputrain.data.tokenizer import load_tokenizer
        from cputrain.objectives.held_out import require_reference

        require_reference(args.path, cfg)
        model, tokenizer = None, load_tokenizer(model_folder(args.path), cfg.model.trust_remote_code)
    else:
        model, tokenizer = load_for_inference(args.path, cfg.model.trust_remote_code)
    _, data = prepare(cfg, tokenizer)
    rows = rows_of(data, "val")
    if args.split != "val" or len(rows) == 0:
        rows = rows_of(data, "train")
    if preference:  # held-out pairs: the objective's loss, reward accuracy and margin (TRL's names)
        from cputrain.objectives.held_out import evaluate_pairs

        result = evaluate_pairs(args.path, cfg, rows, args.max_sequences)
    else:
        result = evaluate_loss(model, rows, args.max_sequences, cfg.train.micro_batch_size)
    result.update({"model": model_folder(args.path), "data": cfg.data.source, "split": args.split})
    from cputrain.metrics.finite_json import dumps

    print(dumps(result, indent=2))  # a diverged model's NaN loss is null: NaN is not JSON
    return 0


def _eval_tasks(args, config_path) -> int:
    """`eval RUN --tasks …`: the model on this machine with the run's precision and threads (its
    config.yaml; key=value overrides change them), through lm-evaluation-harness."""
    from pathlib import Path

    from cputrain import lm_harness
    from cputrain.config.file import load_config
    from cputrain.hardware import detect
    from cputrain.inference import model_folder
    from cputrain.config.resolve import resolve

    for flag, value, least in (("--limit", args.limit, 1), ("--num-fewshot", args.num_fewshot, 0),
                               ("--batch-size", args.batch_size, 1)):
        if value is not None and value < least:
            raise UserError(f"{flag} must be at least {least}")
    model_folder(args.path)  # a run without a model is refused first: nothing to evaluate
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


def _resolved_here(config_path, overrides):
    """A config with its "auto" values resolved for one process on this machine, and what the data
    is (data.format, data.train_on: what prepare and eval need), each decision logged."""
    from cputrain.config.file import load_config
    from cputrain.hardware import detect
    from cputrain.config.resolve import resolve
    from cputrain.training.choices import decide_data

    res = resolve(load_config(config_path, overrides), detect(), world_size=1, local_world_size=1)
    decided = decide_data(res)
    for key, value, why in decided.reasons[len(res.reasons):]:
        log.info("auto: %s = %s (%s)", key, value, why)
    return decided.config


def cmd_export(args) -> int:
    from pathlib import Path

    from cputrain.inference import model_folder
    from cputrain.lora.adapter_folder import is_adapter_folder, merge_into_base

    folder = Path(model_folder(args.path))
    if args.gguf is not None:
        return _export_gguf(args, folder)
    if not is_adapter_folder(folder):
        raise UserError(f"'{folder}' is already a plain Hugging Face model (no LoRA adapter to merge); use it as it is")
    if not args.merge:
        raise UserError(f"'{folder}' holds LoRA adapters, which peft loads onto their base; "
                        "add --merge to write them folded into a plain model")
    run = folder.parent if folder.name == "model" else folder
    out = Path(args.out) if args.out else run / "model-merged"
    print(f"merged model: {merge_into_base(folder, out)}")
    return 0


def _export_gguf(args, folder) -> int:
    """`export RUN --gguf TYPE`: a LoRA run's adapters are merged in memory (--merge is implied)."""
    from pathlib import Path

    from cputrain.gguf_export.types import check_type
    from cputrain.gguf_export.write import default_out, export_gguf

    check_type(args.gguf, args.path, str(default_out(folder, "bf16")))
    out = Path(args.out) if args.out else default_out(folder, args.gguf)
    print(f"gguf ({args.gguf}): {export_gguf(folder, args.gguf, out)}")
    return 0


def cmd_prepare(args) -> int:
    from cputrain.data.prepare import prepare

    cfg = _resolved_here(*_config_and_overrides(args))
    _, data = prepare(cfg)
    print(f"{data.stats['records']:,} records → {data.describe()}")
    print(f"token cache: {data.folder}")
    return 0


COMMANDS = {"train": cmd_train, "doctor": cmd_doctor, "generate": cmd_generate, "eval": cmd_eval,
            "prepare": cmd_prepare, "export": cmd_export}


def cmd_plan(args) -> int:
    """Every key the plan reads decided as a run decides it (cputrain.training.choices, a plan's facts),
    then the plan: one config, or the same twice, full fine-tuning and LoRA (--compare-lora)."""
    from cputrain.plan.command import (
        instances_of,
        link_gbit_s_of,
        load_run_config,
        with_time_plan,
        world_size_of,
    )
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
    plan = decide_and_plan(cfg, world_size, nproc_per_node=nproc, instances=instances, config_json=args.model_config)
    time_lines, time_doc = with_time_plan(args, cfg, plan)
    if args.json:
        import json

        print(json.dumps({**plan_document(plan), **time_doc}, indent=2))
    else:
        print("\n".join(table_lines(plan) + time_lines))
    return 0


def cmd_k8s(args) -> int:
    from cputrain.k8s.command import run

    return run(args)


COMMANDS.update(plan=cmd_plan, k8s=cmd_k8s)


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Flags and key=value overrides in any order (`train cfg.yaml --nproc-per-node 2 a.b=1`).

    argparse fills the positionals from the first run of words only, so words after a flag
    come back unparsed; they are the command's overrides (or its config file, if none was
    given). parse_intermixed_args would do this, but it refuses parsers with subcommands.
    """
    args, rest = parser.parse_known_args(argv)
    unknown_flags = [word for word in rest if word.startswith("-")]
    if unknown_flags or (rest and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown_flags or rest)}")
    for word in rest:
        if getattr(args, "config", "") is None and "=" not in word:
            args.config = word
        else:
            args.overrides.append(word)
    return args


def _lost_peer(err: RuntimeError):
    """A rank under the agent whose collective failed on a vanished peer: a PeerLost, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    from cputrain.distributed.lost_peer import lost_peer_error

    return lost_peer_error(err, int(os.environ.get("RANK", "0")))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_command_line(parser, argv)
    args.from_command_line = argv is None  # this process is the command (not a call from Python)
    if args.command is None:
        parser.print_help()
        return 0
    from cputrain.log import setup_logging

    setup_logging(int(os.environ.get("RANK", "0")))
    try:
        try:
            return COMMANDS[args.command](args)
        except RuntimeError as err:
            lost = _lost_peer(err) if not args.debug else None
            if lost is None:
                raise
            raise lost from None
    except UserError as err:
        if args.debug:
            raise
        print(f"{err.label}{err}", file=sys.stderr)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # a rank under the agent: hand it the message
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(err)
        return err.exit_code
    except KeyboardInterrupt:
        print("cputrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
