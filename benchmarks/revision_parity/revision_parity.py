"""Does a change of the code's layout change what a run computes? Two revisions, side by side.

    python benchmarks/revision_parity/revision_parity.py BEFORE [AFTER]       (git revisions; AFTER: HEAD)
    python benchmarks/revision_parity/revision_parity.py --sharded BEFORE [AFTER]

For a restructuring that must change no behaviour, each revision is checked out in a temporary
worktree and run from there (its own code and configs, this venv), alternated:

- the demo (`cputrain train`, configs/demo.yaml's defaults) 3 times each: loss per logged step
  and the median tokens/s of steps 10 on;
- the SFT demo (configs/demo-sft.yaml) on that revision's own demo model;
- a LoRA run: the SFT demo with model.lora.enabled=true;
- the DPO demo (configs/demo-dpo.yaml: LoRA DPO on pydoc's pairs), the KTO demo (configs/demo-kto.yaml:
  LoRA KTO on thumbs-up/down answers) and the reward demo (configs/demo-reward.yaml: a LoRA reward
  model on pairs), each on that revision's SFT model.

With the same tokenizer and kernels: the demo's tokenizer is trained once (by BEFORE) and given
to every run, and the attention kernel is fixed (sdpa), since `auto` times both kernels at start
and may pick either, whose bf16 results differ. Each revision tokenizes into its own cache, so a
change in tokenizing shows up too. Losses must agree to 4 decimals at every logged step (the same
revision run twice agrees exactly); the speed ratio is after ÷ before. Writes block
`revision-parity` of docs/benchmarks/revision-parity.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.runner.blocks import write_block  # noqa: E402
from benchmarks.runner.machine import machine_line  # noqa: E402

DEMO_RUNS = 3
DPO_STEPS = 20  # of the DPO demo's 40, and of the KTO and reward demos' 40
# The post-training demos run on the SFT demo's model: (row name, config).
PREFERENCE_DEMOS = {"DPO": "configs/demo-dpo.yaml", "KTO": "configs/demo-kto.yaml", "reward": "configs/demo-reward.yaml"}
SFT_STEPS = 60  # of the SFT demo's 150: the losses either agree from the start or they do not
SHARDED_STEPS = 20
# (row name, overrides): the demo on 2 ranks; every other key left to auto on both sides
SHARDED_CASES = [(f"{name}, {precision}", [f"parallel.strategy={strategy}", f"hardware.precision={precision}", *extra])
                 for precision in ("bf16", "fp32")
                 for name, strategy, extra in (("fsdp, layout auto", "fsdp", []),
                                               ("fsdp, full_shard", "fsdp", ["parallel.layout=full_shard"]),
                                               ("zero3", "zero3", []))]


def _worktree(rev: str, root: Path) -> tuple[Path, str]:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout.strip()
    folder = root / f"rev-{sha}"
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(folder), rev], cwd=REPO, check=True,
                   capture_output=True)
    return folder, sha


@contextmanager
def _worktrees(before: str, after: str, root: Path):
    """{"before": (folder, sha), "after": (folder, sha)}, each a worktree under `root`, removed after."""
    trees = dict(before=_worktree(before, root), after=_worktree(after, root))
    try:
        yield trees
    finally:
        for tree, _ in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)


def _block(name: str, title: str, command: str, columns: list[str], table: list[str], after: str) -> None:
    """Block `name`: its title, the machine, the command and what it ran, the table (`columns`: the
    first 3 are the run, its logged steps and its largest loss difference), a closing line."""
    header = "| " + " | ".join(columns) + " |"
    rule = "| --- | ---: | ---: |" + " --- |" * (len(columns) - 3)
    write_block(name, "\n".join([title, "", machine_line(), "", command, "", header, rule, *table, "", after]))


def _equal(worst: float) -> str:
    return "yes" if worst < 5e-5 else "NO"


def _train(tree: Path, out: Path, cache: Path, *args: str, ranks: int = 1) -> list[dict]:
    """One `cputrain train` of the revision in `tree` (its code first on the path), on `ranks`
    ranks of this node; its metrics rows."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "cputrain", "train", *args, f"output_dir={out}", f"data.cache_dir={cache}",
           "train.sample_tokens=0", *(["--nproc-per-node", str(ranks)] if ranks > 1 else [])]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {tree}:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _shared_tokenizer(tree: Path, root: Path) -> Path:
    """The demo's tokenizer, trained once by the revision in `tree`, for every run of both."""
    out, cache = root / "tokenizer-run", root / "tokenizer-cache"
    _train(tree, out, cache, "train.max_steps=1", "train.eval_every=1", "train.checkpoint_every=1")
    return next(p for p in (cache / "tokenizers").iterdir() if p.is_dir())


def _losses(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if r.get("loss") is not None}


def _tokens_per_s(rows: list[dict]) -> float:
    rates = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s") and r["step"] >= 10]
    return statistics.median(rates)


def _worst(a: dict[int, float], b: dict[int, float]) -> float:
    if sorted(a) != sorted(b):
        raise SystemExit(f"the runs logged different steps: {sorted(a)[:5]}… vs {sorted(b)[:5]}…")
    return max(abs(a[s] - b[s]) for s in a)


def _decided(run: Path) -> str:
    """What the run's config.yaml decided that a sharded case's losses depend on."""
    import yaml

    cfg = yaml.safe_load((run / "config.yaml").read_text())
    parallel, model = cfg["parallel"], cfg["model"]
    said = [parallel["strategy"]]
    if parallel["strategy"] == "fsdp":
        said += [parallel.get("layout", "?"), f"reduce {parallel.get('reduce_dtype', '?')}"]
    return " ".join(said + [str(model.get("attn_implementation", "?"))])


def sharded(before: str, after: str) -> None:
    """The demo on 2 ranks under each sharding strategy, before and after: block revision-parity-sharded."""
    import importlib.util

    cases = [(n, o) for n, o in SHARDED_CASES
             if "parallel.strategy=zero3" not in o or importlib.util.find_spec("deepspeed")]
    with tempfile.TemporaryDirectory(prefix="revision-parity-") as tmp:
        root = Path(tmp)
        found = []
        with _worktrees(before, after, root) as trees:
            tokenizer = _shared_tokenizer(trees["before"][0], root)
            # micro-batches of 2: each rank accumulates 2 a step, where the layouts differ
            fixed = [f"model.tokenizer={tokenizer}", "model.attn_implementation=sdpa", "train.micro_batch_size=2",
                     "train.log_every=1", f"train.max_steps={SHARDED_STEPS}", "train.eval_every=10", f"train.checkpoint_every={SHARDED_STEPS}"]
            again = None
            for i, (name, overrides) in enumerate(cases):
                runs, decided = {}, {}
                for side, (tree, _) in trees.items():  # alternated, case by case
                    out = root / f"{side}-sharded-{i}"
                    runs[side] = _losses(_train(tree, out, root / f"{side}-cache", *fixed, *overrides, ranks=2))
                    decided[side] = _decided(out)
                if again is None:
                    out = root / "after-sharded-again"
                    again = _worst(runs["after"], _losses(_train(trees["after"][0], out, root / "after-cache",
                                                                 *fixed, *overrides, ranks=2)))
                worst = _worst(runs["before"], runs["after"])
                found.append((name, len(runs["after"]), worst, decided["before"], decided["after"]))
                print(f"{name}: {worst:.2e} ({decided['before']} → {decided['after']})", flush=True)
    table = [f"| {name} | {steps} | {worst:.2e} | {_equal(worst)} | {b} | {'the same' if a == b else a} |"
             for name, steps, worst, b, a in found]
    sha_before, sha_after = trees["before"][1], trees["after"][1]
    _block("revision-parity-sharded", "## Sharded runs before and after",
           f"`python benchmarks/revision_parity/revision_parity.py --sharded {sha_before} {sha_after}`: the demo on "
           f"2 ranks of one node, {SHARDED_STEPS} steps of 2 micro-batches of 2 a rank, the loss of every step, each "
           "revision from its own worktree and token cache, alternated case by case; the same tokenizer and "
           "attention kernel (sdpa) on both sides, every other key left to auto.",
           ["run", "logged steps", "largest loss difference", "equal to 4 decimals", "decided before",
            "decided after"], table,
           f"The after revision run again ({cases[0][0]}): largest loss difference {again:.1e}.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", default="HEAD")
    parser.add_argument("--sharded", action="store_true", help="the sharded strategies on 2 ranks instead")
    args = parser.parse_args()
    if args.sharded:
        return sharded(args.before, args.after)
    with tempfile.TemporaryDirectory(prefix="revision-parity-") as tmp:
        root = Path(tmp)
        with _worktrees(args.before, args.after, root) as trees:
            tokenizer = _shared_tokenizer(trees["before"][0], root)
            fixed = [f"model.tokenizer={tokenizer}", "model.attn_implementation=sdpa"]
            demo = {side: [] for side in trees}
            for i in range(DEMO_RUNS):  # alternated, so drift in the machine hits both alike
                for side, (tree, _) in trees.items():
                    demo[side].append(_train(tree, root / f"{side}-demo-{i}", root / f"{side}-cache", *fixed))
                    print(f"demo {side} {i}: {_tokens_per_s(demo[side][-1]):,.0f} tokens/s", flush=True)
            sft, lora, preference = {}, {}, {name: {} for name in PREFERENCE_DEMOS}
            for side, (tree, _) in trees.items():
                base = root / f"{side}-demo-0" / "model"
                common = ["configs/demo-sft.yaml", f"model.name_or_path={base}", f"train.max_steps={SFT_STEPS}",
                          "train.eval_every=30", f"train.checkpoint_every={SFT_STEPS}",
                          "model.attn_implementation=sdpa"]
                sft[side] = _train(tree, root / f"{side}-sft", root / f"{side}-cache", *common)
                lora[side] = _train(tree, root / f"{side}-lora", root / f"{side}-cache", *common,
                                    "model.lora.enabled=true", "train.lr=1e-2")
                for name, config in PREFERENCE_DEMOS.items():
                    preference[name][side] = _train(
                        tree, root / f"{side}-{name}", root / f"{side}-cache", config,
                        f"model.name_or_path={root / f'{side}-sft' / 'model'}", f"train.max_steps={DPO_STEPS}",
                        f"train.checkpoint_every={DPO_STEPS}", "model.attn_implementation=sdpa")
    demo_worst = max(_worst(_losses(a), _losses(b)) for a, b in zip(demo["before"], demo["after"]))
    repeat_worst = max(_worst(_losses(runs[0]), _losses(runs[i])) for runs in demo.values() for i in range(1, DEMO_RUNS))
    speed = {side: statistics.median(_tokens_per_s(rows) for rows in runs) for side, runs in demo.items()}
    rows = [
        ("demo (3 runs each)", demo_worst, len(_losses(demo["after"][0]))),
        (f"SFT demo, {SFT_STEPS} steps", _worst(_losses(sft["before"]), _losses(sft["after"])),
         len(_losses(sft["after"]))),
        (f"LoRA SFT, {SFT_STEPS} steps", _worst(_losses(lora["before"]), _losses(lora["after"])),
         len(_losses(lora["after"]))),
        *((f"{name} demo (LoRA), {DPO_STEPS} steps", _worst(_losses(runs["before"]), _losses(runs["after"])),
           len(_losses(runs["after"]))) for name, runs in preference.items()),
    ]
    table = [f"| {name} | {steps} | {worst:.2e} | {_equal(worst)} |" for name, worst, steps in rows]
    print("\n".join(table))
    sha_before, sha_after = trees["before"][1], trees["after"][1]
    _block("revision-parity", "## The same run before and after a restructuring",
           f"`python benchmarks/revision_parity/revision_parity.py {sha_before} {sha_after}`: each revision from its "
           "own worktree and token cache, alternated. Losses must agree to 4 decimals at every logged step.",
           ["run", "logged steps", "largest loss difference", "equal to 4 decimals"], table,
           f"The same revision run again: largest loss difference {repeat_worst:.1e}. "
           f"Demo tokens/s, median of {DEMO_RUNS} runs (median of steps 10 on in each): before "
           f"{speed['before']:,.0f}, after {speed['after']:,.0f}, ratio {speed['after'] / speed['before']:.3f}.")


if __name__ == "__main__":
    main()
