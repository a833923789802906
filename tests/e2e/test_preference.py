"""Preference tuning through the CLI on a tiny model: LoRA DPO on builtin:pydoc-dpo starts at
ln 2 (the policy is its reference), logs TRL's figures per step and at validation and puts them
in summary.json; the first step's loss does not depend on the micro-batch size; a stopped and
resumed run equals a straight one; full-weight DPO (its reference computed before training) starts
at ln 2 too; SimPO trains full weights; each step logs the pairs it held, and a batch of more rows
than the pairs made is refused; the adapter folder and its merge generate in transformers' pipeline."""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest

from harness.run_cli import run_cli
from harness.run_cli_here import run_cli_here
from harness.run_metrics import losses_by_step, metrics_rows
from harness.tiny_run import tiny_overrides

DPO = {"data.source": "builtin:pydoc-dpo", "data.format": "auto", "data.seq_len": 256, "data.val_fraction": 0.1,
       "train.objective": "dpo", "model.lora.enabled": "true",
       "model.lora.rank": 4, "train.lr": 1e-2, "train.max_steps": 6, "train.eval_every": 3,
       "train.checkpoint_every": 3}
KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
        "logps/rejected")


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model()


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir, base):
    out = tmp_path_factory.mktemp("dpo") / "straight"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{"model.name_or_path": base, **DPO}), check=True)
    # precomputed by default, LoRA too, and kept beside the token cache
    assert "computed before training" in proc.stderr and "kept in" in proc.stderr, proc.stderr[-2000:]
    # data.shared_prompt=auto: the prompt laid out once per pair, the choice and its reason recorded
    assert "auto: data.shared_prompt = True (preference pairs: the prompt is computed once" in proc.stderr
    assert "# data.shared_prompt = True: preference pairs" in (out / "config.yaml").read_text()
    assert "the shared prompt (data.shared_prompt) saved" in proc.stderr, proc.stderr[-2000:]
    return out


def test_lora_dpo_starts_at_ln2_and_records_trls_figures(straight):
    rows = metrics_rows(straight)
    first = rows[0]
    assert first["step"] == 1 and abs(first["loss"] - math.log(2)) < 1e-4
    # at step 1 the adapters are zero: the policy is its reference, every reward 0
    assert first["rewards/margins"] == pytest.approx(0, abs=1e-5) and first["rewards/accuracies"] == 0
    assert all(key in r for r in rows if "loss" in r for key in KEYS)
    assert all(r["pairs_per_s"] > 0 for r in rows if "loss" in r)
    # after one update the adapters are no longer zero: the policy has moved away from its reference
    assert rows[1]["rewards/margins"] != 0 and rows[1]["loss"] != first["loss"]
    evals = [r for r in rows if "eval_rewards/accuracies" in r]
    assert [r["step"] for r in evals] == [3, 6] and all(math.isfinite(r["val_loss"]) for r in evals)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["objective"] == "dpo" and summary["lora"] is True
    for key in KEYS:
        assert summary[key] is not None and summary[f"eval_{key}"] is not None
    assert summary["first_eval_rewards/accuracies"] == evals[0]["eval_rewards/accuracies"]
    assert summary["pairs_per_s"] > 0


def _evaluated_like_the_run(run) -> dict:
    """`cputrain eval RUN` on the rows the run validated on (train.eval_batches 2 × micro-batch 4)
    gives the run's own last validation figures: the same pairs, reference and weights."""
    last = [r for r in metrics_rows(run) if "eval_rewards/accuracies" in r][-1]
    result = json.loads(run_cli("eval", run, "--max-sequences", 8, check=True).stdout)
    assert result["objective"] == "dpo" and result["pairs"] > 0
    assert result["loss"] == pytest.approx(last["val_loss"], abs=1e-5)
    for key in KEYS:
        assert result[key] == pytest.approx(last[f"eval_{key}"], abs=1e-5), key
    return result


def test_each_step_logs_the_pairs_it_held_and_the_summary_their_mean(straight):
    """Packed rows hold a varying number of pairs: a step of 8 rows says how many pairs it trained
    (TRL's batch counts pairs), and summary.json their mean over the logged steps."""
    rows = [r for r in metrics_rows(straight) if "loss" in r]
    per_step = [r["pairs_per_step"] for r in rows]
    assert all(p >= 8 and p == int(p) for p in per_step), per_step  # log_every=1: each step's own count
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["pairs_per_step"] == pytest.approx(sum(per_step) / len(per_step))


def test_a_batch_of_more_rows_than_the_pairs_made_is_refused_before_the_model_is_built(tmp_path, cache_dir, base,
                                                                                      straight):
    """A batch of more rows than the packed pairs made (8 pairs packed into 1 row with a batch of 8
    trained that row 8 times a step, epoch 8.0 after step 1) is refused in one line that says what
    the data made and what fits, before the model, the reference or a checkpoint exists. On the
    straight run's data: its token cache is built already."""
    out = tmp_path / "run"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{"model.name_or_path": base, **DPO,
                                                              "train.global_batch_size": 128}))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    refusal = re.search(r"train.global_batch_size \(128\) is more than the training set: (\d+) rows holding (\d+) "
                        r"preference pairs; a step would train the same rows several times over; set "
                        r"train.global_batch_size=(\d+), or set the batch in pairs, one a row, as TRL counts it: "
                        r"train.global_batch_pairs=(\d+) with data.packing=false", proc.stderr)
    assert refusal, proc.stderr[-2000:]
    rows, pairs, fits, in_pairs = map(int, refusal.groups())
    assert rows < pairs and fits == rows - rows % 4 and in_pairs == min(128, pairs)
    assert "DPO reference" not in proc.stderr and not (out / "checkpoints").exists()


def test_eval_of_a_lora_run_scores_held_out_pairs_against_the_base(straight):
    assert _evaluated_like_the_run(straight)["reference"] == "the LoRA base, adapters off"


def test_the_adapter_folder_and_its_merge_generate_in_a_transformers_pipeline(straight, base, tmp_path):
    """model/ of a LoRA run names its base, which transformers' pipeline loads the adapters onto;
    `cputrain export --merge` (in this process) writes a folder that names its class and ends a
    generation at EOS and at the end of a chat turn. Greedy, both write the same tokens."""
    from transformers import pipeline

    from cputrain.model.folder_description import generation_end_ids

    adapters, merged = straight / "model", tmp_path / "merged"
    assert json.loads((adapters / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base.resolve())
    run_cli_here("export", straight, "--merge", "--out", merged, check=True)
    assert json.loads((merged / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    written = {}
    for folder in (adapters, merged):
        pipe = pipeline("text-generation", model=str(folder))
        ends = set(generation_end_ids(pipe.tokenizer))
        # the adapter folder's own generation_config.json says it too, for whoever loads it with peft
        eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
        assert ends <= set(eos if isinstance(eos, list) else [eos]), (folder.name, eos)
        written[folder.name] = pipe("What is", max_new_tokens=6, do_sample=False, return_tensors=True)
    assert written["model"] == written["merged"]
    assert len(written["merged"][0]["generated_token_ids"]) > 2


def test_the_first_step_does_not_depend_on_the_micro_batch_or_the_ranks(tmp_path, cache_dir, base, straight):
    one_step = {"model.name_or_path": base, **DPO, "train.max_steps": 1}
    one_by_one, two_ranks = tmp_path / "micro1", tmp_path / "ranks2"
    run_cli("train", *tiny_overrides(one_by_one, cache_dir, **one_step, **{"train.micro_batch_size": 1}), check=True)
    # a token cache of its own: the reference is computed again, each rank its share of the pairs
    proc = run_cli("train", *tiny_overrides(two_ranks, tmp_path / "cache", **one_step, **{"train.micro_batch_size": 2}),
                   "--nproc-per-node", "2", check=True)
    assert "over 2 rank(s)" in proc.stderr, proc.stderr[-2000:]
    first = metrics_rows(straight)[0]
    for out in (one_by_one, two_ranks):
        row = metrics_rows(out)[0]
        assert abs(row["loss"] - first["loss"]) < 1e-5, (out.name, row["loss"], first["loss"])
        assert abs(row["grad_norm"] - first["grad_norm"]) < 1e-5 * max(1.0, first["grad_norm"]), out.name


def test_a_shared_prompt_trains_as_two_whole_sequences(tmp_path, cache_dir, base, straight):
    """One pair per row (data.packing=false), so both layouts put the same pairs in each step:
    the prompt laid out once (data.shared_prompt=true) or twice (false), the same losses. Packed,
    a shared row holds more pairs, and a step of rows more pairs than unshared. The demo's pairs with
    answers cut to 100 characters, so every pair fits both layouts (pairs that fit only shared are
    kept shared and dropped unshared: other pairs, other steps)."""
    from cputrain.data.sources import BUILTINS

    data = tmp_path / "pairs.jsonl"
    with open(data, "w") as f:
        for pair in BUILTINS["builtin:pydoc-dpo"]():
            for answer in ("chosen", "rejected"):
                pair[answer][0]["content"] = pair[answer][0]["content"][:100]
            f.write(json.dumps(pair) + "\n")
    losses, norms = {}, {}
    for shared in ("true", "false"):
        out = tmp_path / f"shared-{shared}"
        proc = run_cli("train", *tiny_overrides(out, cache_dir, **{
            "model.name_or_path": base, **DPO, "data.source": data, "train.max_steps": 3, "train.eval_every": 100,
            "train.checkpoint_every": 100, "data.packing": "false", "data.shared_prompt": shared}), check=True)
        assert "dropped 0 longer than data.seq_len" in proc.stderr, proc.stderr[-2000:]
        losses[shared] = losses_by_step(out)
        norms[shared] = [r["grad_norm"] for r in metrics_rows(out) if "grad_norm" in r]
    assert sorted(losses["true"]) == [1, 2, 3] and losses["true"][3] != losses["true"][1]
    for step in (1, 2, 3):
        assert losses["true"][step] == pytest.approx(losses["false"][step], abs=1e-4), step
    assert norms["true"] == pytest.approx(norms["false"], rel=1e-4)


def test_stop_and_resume_equals_the_straight_run(tmp_path, cache_dir, base, straight):
    split = tmp_path / "split"
    overrides = {"model.name_or_path": base, **DPO}
    stopped = run_cli("train", *tiny_overrides(split, cache_dir, **overrides, **{"train.stop_at_step": 3}),
                      check=True)
    resumed = run_cli("train", *tiny_overrides(split, cache_dir, **overrides), check=True)
    assert "resumed from" in resumed.stderr
    # the straight run's reference, kept beside the token cache, is read back, not computed again
    for proc in (stopped, resumed):
        assert "pairs read from" in proc.stderr and "computed before training" not in proc.stderr, proc.stderr[-2000:]
    a, b = losses_by_step(straight), losses_by_step(split)
    assert sorted(b) == list(range(1, 7))
    for step in range(1, 7):
        assert a[step] == pytest.approx(b[step], abs=1e-6), step


FULL = {**DPO, "model.lora.enabled": "false", "train.lr": 1e-3, "train.max_steps": 2, "train.eval_every": 2}


@pytest.fixture(scope="module")
def full(tmp_path_factory, cache_dir, base):
    out = tmp_path_factory.mktemp("dpo") / "full"
    run_cli("train", *tiny_overrides(out, cache_dir, **{"model.name_or_path": base, **FULL}), check=True)
    return out


def test_full_weight_dpo_starts_at_ln2_against_its_precomputed_reference(full, base):
    rows = [r for r in metrics_rows(full) if "loss" in r]
    assert abs(rows[0]["loss"] - math.log(2)) < 1e-4 and rows[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert rows[1]["rewards/margins"] != 0  # the policy moved away from the reference kept in memory
    # eval loads the reference from the folder the run started from, then the trained model
    assert _evaluated_like_the_run(full)["reference"] == str(base)


@pytest.mark.parametrize("strategy", ["fsdp", "zero3"])
def test_full_weight_dpo_on_two_sharded_ranks_takes_one_ranks_first_step(tmp_path, cache_dir, base, full, strategy):
    """FSDP2 and ZeRO-3 shard every weight and gather it around each forward, the reference pass
    before training included (ZeRO-3's engine exists only once the optimizer does): two ranks'
    first step is the single rank's. The sharded runs read log-probabilities through the
    block-wise head (model.chunked_loss), the single one from the whole logits: the trained head's
    gradient, gathered or partitioned, is the same."""
    if strategy == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("zero3 needs the deepspeed extra")
    out = tmp_path / strategy
    run_cli("train", *tiny_overrides(out, cache_dir, **{"model.name_or_path": base, **FULL, "train.max_steps": 1,
                                                        "parallel.strategy": strategy,
                                                        "model.chunked_loss": "true"}),
            "--nproc-per-node", "2", check=True)
    one, two = metrics_rows(full)[0], metrics_rows(out)[0]
    for key in ("loss", "grad_norm", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-5), key


def test_simpo_trains_full_weights(tmp_path, cache_dir, base):
    out = tmp_path / "simpo"
    overrides = {"model.name_or_path": base, **DPO, "train.objective": "simpo", "model.lora.enabled": "false",
                 "train.lr": 1e-3, "train.max_steps": 2, "train.eval_every": 2}
    run_cli("train", *tiny_overrides(out, cache_dir, **overrides), check=True)
    rows = [r for r in metrics_rows(out) if "loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and "rewards/margins" in r for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["objective"] == "simpo" and summary["eval_rewards/accuracies"] is not None


@pytest.mark.parametrize("records, message", [
    ([{"prompt": "Q ", "chosen": "same", "rejected": "same"}] * 20, "no training pair in"),
    ([{"prompt": "Q ", "chosen": "yes"}] * 20, "has no field 'rejected'"),
])
def test_pairs_that_teach_nothing_or_lack_a_field_stop_in_one_line(tmp_path, cache_dir, base, records, message):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = run_cli("train", *tiny_overrides(tmp_path / "run", cache_dir, **{
        "model.name_or_path": base, **DPO, "data.source": data, "data.format": "preference"}))
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_lora_reference_precomputed_or_live_trains_alike(tmp_path, cache_dir, base, straight):
    """The precomputed reference (the default) is the base with the adapters off, as the live one
    run on every micro-batch: the same losses, step after step (fp32). The live run reads its
    log-probabilities through the block-wise head (model.chunked_loss; a frozen head under LoRA),
    the straight one from the whole logits."""
    out = tmp_path / "live"
    proc = run_cli("train", *tiny_overrides(out, cache_dir, **{"model.name_or_path": base, **DPO, "train.max_steps": 3,
                                                               "train.dpo_reference": "live",
                                                               "model.chunked_loss": "true"}), check=True)
    assert "DPO reference:" not in proc.stderr
    precomputed, live = losses_by_step(straight), losses_by_step(out)
    assert sorted(live) == [1, 2, 3]
    for step in live:
        assert live[step] == pytest.approx(precomputed[step], abs=1e-5), (step, live, precomputed)


def test_a_live_reference_without_lora_is_refused_before_work(tmp_path, cache_dir, base):
    proc = run_cli_here("train", *tiny_overrides(tmp_path / "run", cache_dir, **{
        "model.name_or_path": base, **DPO, "model.lora.enabled": "false", "train.dpo_reference": "live"}))
    assert proc.returncode == 2 and "train.dpo_reference=live" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
