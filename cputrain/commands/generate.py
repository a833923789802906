"""`cputrain generate PATH`: text sampled from a run's model or a model folder, a prompt
continued or (--chat) a user's message answered."""

from __future__ import annotations

import argparse

from cputrain.errors import UserError


def add_parser(sub) -> argparse.ArgumentParser:
    gen = sub.add_parser("generate", help="sample text from a run folder or an exported model folder")
    gen.add_argument("path", help="run folder (its model/ is used) or Hugging Face model folder")
    gen.add_argument("--prompt", default="The", help="text to continue (default: %(default)r)")
    gen.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    gen.add_argument("--chat", metavar="MESSAGE", help="a user's message, answered in the model's chat template "
                     "(the reply stops at the end of its turn); replaces --prompt")
    return gen


def run(args) -> int:
    from cputrain.finished.generate import generate_text

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if not args.temperature >= 0 or args.temperature == float("inf"):  # a negative one decoded greedily, unsaid
        raise UserError(f"--temperature must be 0 (greedy) or a positive number (got {args.temperature:g})")
    if args.top_k < 0:
        raise UserError(f"--top-k must be 0 (no cut) or a positive number of tokens (got {args.top_k})")
    chat = args.chat is not None
    print(generate_text(args.path, args.chat if chat else args.prompt, args.max_new_tokens, args.temperature,
                        args.top_k, args.seed, chat=chat))
    return 0
