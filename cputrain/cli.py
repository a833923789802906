"""`cputrain` command line: train, prepare, doctor, generate, eval, score, export, plan, k8s.

Every user error ends as one line on stderr and exit code 2; `--debug` shows the traceback.
Each subcommand, its parser and its body, is a module of cputrain.commands.
"""

from __future__ import annotations

import argparse
import os
import sys

from cputrain.commands import doctor, export, generate, k8s, plan, prepare, score, train
from cputrain.commands import eval as eval_command  # under its own name it would hide the builtin eval
from cputrain.errors import UserError

EXAMPLES = """examples:
  cputrain train                                   # the built-in demo: small Llama on Python's docs
  cputrain train configs/finetune-local.yaml train.max_steps=20
  cputrain prepare configs/llama3-8b-fsdp.yaml          # tokenize into data.cache_dir ahead of a job
  cputrain doctor
  cputrain generate runs/default --prompt "The list"
  cputrain generate runs/demo-sft --chat "What is the assert statement in Python?"
  cputrain eval runs/default
  cputrain eval runs/default --tasks hellaswag,arc_easy --limit 100   # lm-evaluation-harness benchmarks
  cputrain score runs/demo-reward --data answers.jsonl --out scored.jsonl   # a reward model's scores
  cputrain export runs/lora --merge                # a LoRA run's adapters folded into a plain model
  cputrain export runs/default --gguf q8_0         # one GGUF file for llama.cpp and Ollama
"""

# Each name's module, in the order --help lists them.
COMMANDS = {"train": train, "doctor": doctor, "generate": generate, "eval": eval_command, "score": score,
            "export": export, "prepare": prepare, "plan": plan, "k8s": k8s}


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
    for command in COMMANDS.values():
        _add_common(command.add_parser(sub))
    return parser


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
    """A rank under the agent whose collective failed on a vanished or silent peer: a PeerLost, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    from cputrain.distributed import group_nodes
    from cputrain.distributed.lost_peer import lost_peer_error

    made, allowed = (os.environ.get(k, "") for k in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"))
    restarts = (int(made), int(allowed)) if made.isdigit() and allowed.isdigit() else None
    return lost_peer_error(err, int(os.environ.get("RANK", "0")), group_nodes.known(), restarts)


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
            return COMMANDS[args.command].run(args)
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
