"""What the tests share beyond pytest's fixtures, one idea per module (tests/harness/README.md):

- `repo`: the repository's folders;
- `tiers`, `budget`, `alone_lock`: which tests are slow, the suite's time budget, running alone under xdist;
- `cli_env`, `tiny_run`, `tiny_model`, `chat_data`: a command's environment, a run that takes seconds, a
  tiny Llama with its tokenizer, chat data;
- `run_metrics`, `trl_peer`: a finished run's metrics.jsonl; what the comparisons with TRL share;
- `run_cli`, `start_cli`, `run_cli_here`: a `cputrain` command forked warm (or fresh), started and not
  waited for, or in the test's own process;
- `warm_client`, `rank_server`: the clients of `warm_interpreter.py`, the fork servers, and of its rank
  server, whose stand-in `rank_python.py` is the `python` torchrun starts for each rank.

Tests import what they use from its module (`from harness.run_cli import run_cli`); this file
imports nothing, so importing the package costs nothing and holds no state of its own.
"""
