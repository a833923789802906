"""Online RL through the CLI on a tiny model: a LoRA GRPO run with the KL to the reference (the
adapters off) and two weighted rewards logs TRL's figures and the rollout's speed, keeps sample
completions with their rewards in completions.jsonl, and a run stopped at step 1, inside a cycle of
num_iterations μ = 2, and resumed equals a straight one (the sampling generator's state and the
cycle's kept rollouts are in the checkpoint); RLOO with full
weights and the block-wise head (model.chunked_loss) trains; bad input is refused in one line before any work (in-process), a prompt that
leaves no room to sample before the model is built."""

from __future__ import annotations

import json

import pytest

from harness.run_cli import run_cli
from harness.run_cli_here import run_cli_here
from harness.run_metrics import metrics_rows
from harness.tiny_run import tiny_overrides

RL = {"data.format": "auto", "data.seq_len": 64, "data.val_fraction": 0.1, "data.max_documents": "null",
      "train.objective": "grpo", "train.rewards": '[exact_answer, "regex:^ [a-z]"]', "train.reward_weights": "[1.0,0.5]",
      "train.num_generations": 4, "train.max_completion_length": 12, "train.global_batch_size": 16,
      "train.micro_batch_size": 8, "train.max_steps": 4, "train.eval_every": 2, "train.checkpoint_every": 2,
      "model.lora.enabled": "true", "model.lora.rank": 4, "train.rl_beta": 0.04, "train.lr": 1e-2,
      "train.warmup_steps": 0, "train.num_iterations": 2}
TRL_KEYS = ("reward", "reward_std", "rewards/exact_answer/mean", "rewards/regex:^ [a-z]/mean",
            "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std", "kl",
            "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "rollout/tokens_per_s")


@pytest.fixture(scope="module")
def base(tiny_model):
    return tiny_model()


@pytest.fixture(scope="module", autouse=True)
def prompts(tmp_path_factory):
    """Prompt-only records with an `answer` column: the run's data.source."""
    from pydoc_data.topics import topics

    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with open(path, "w") as f:
        for name in sorted(topics)[:80]:
            f.write(json.dumps({"prompt": f"Topic: {name}\nFirst word:", "answer": name}) + "\n")
    RL["data.source"] = str(path)
    return path


def _args(out, cache_dir, base, **extra):
    return tiny_overrides(out, cache_dir, **{"model.name_or_path": base, **RL, **extra})


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir, base):
    out = tmp_path_factory.mktemp("grpo") / "straight"
    run_cli("train", *_args(out, cache_dir, base), check=True)
    return out


def test_a_grpo_run_logs_trls_figures_and_keeps_completions(straight):
    rows = metrics_rows(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in TRL_KEYS:
        assert all(key in r for r in rows), key
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0  # the policy starts as its reference
    assert "eval_reward" in rows[1] and rows[1]["val_loss"] == -rows[1]["eval_reward"]
    kept = [json.loads(line) for line in (straight / "completions.jsonl").read_text().splitlines()]
    # one group of 4 a sampled step: μ = 2 samples at steps 1 and 3 and trains 2 and 4 on those rollouts again
    assert {k["step"] for k in kept} == {1, 3} and len(kept) == 8
    assert {"prompt", "completion", "rewards/exact_answer", "rewards/regex:^ [a-z]", "advantage"} <= set(kept[0])


def test_a_stopped_grpo_run_resumes_to_the_same_figures(straight, tmp_path, cache_dir, base):
    """Stopped after step 1, inside a cycle of μ = 2: step 2 trains on step 1's kept rollouts, step 3
    samples from the kept generator state."""
    out = tmp_path / "resumed"
    run_cli("train", *_args(out, cache_dir, base, **{"train.stop_at_step": 1}), check=True)
    proc = run_cli("train", *_args(out, cache_dir, base), check=True)
    assert "resumed from" in proc.stderr
    assert "rollouts: the fused decoder" in proc.stderr  # a LoRA Llama: its merged weights sample
    ours = [(r["step"], r["loss"], r["grad_norm"], r["reward"]) for r in metrics_rows(out)]
    theirs = [(r["step"], r["loss"], r["grad_norm"], r["reward"]) for r in metrics_rows(straight)]
    assert ours == theirs


def test_rloo_with_full_weights_and_the_block_wise_head_trains(tmp_path, cache_dir, base):
    out = tmp_path / "rloo"
    run_cli("train", *_args(out, cache_dir, base, **{"train.objective": "rloo", "model.lora.enabled": "false",
                                                       "train.rl_beta": 0.0, "train.max_steps": 2,
                                                       "model.chunked_loss": "true"}), check=True)
    rows = metrics_rows(out)
    assert len(rows) == 2 and all("reward" in r and "kl" not in r for r in rows)
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in rows)  # finite, and the head's weight trained


def test_a_prompt_that_leaves_no_room_to_sample_is_refused_before_the_model(tmp_path, cache_dir, base):
    proc = run_cli("train", *_args(tmp_path / "run", cache_dir, base, **{"train.max_completion_length": 60}))
    assert proc.returncode == 2 and "train.max_completion_length (60) = 4 leave for it" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("extra, expect", [
    ({"train.rewards": "[no_such_module_here:f]", "train.reward_weights": "null"},
     "train.rewards: cannot import module 'no_such_module_here'"),
    ({"train.num_generations": 16, "train.global_batch_size": 24}, "must be a multiple of train.num_generations (16)"),
    ({"model.lora.enabled": "false"}, "train.rl_beta=0.04 needs a reference, and with full weights"),
    ({"train.objective": "rloo", "data.format": "feedback"}, "train.objective=rloo samples its completions"),
])
def test_bad_input_is_refused_in_one_line_before_any_work(tmp_path, cache_dir, base, extra, expect):
    proc = run_cli_here("train", *_args(tmp_path / "run", cache_dir, base, **extra))
    assert proc.returncode == 2 and expect in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_reward_folder_that_is_not_a_reward_model_is_refused(tmp_path, cache_dir, base):
    proc = run_cli_here("train", *_args(tmp_path / "run", cache_dir, base, **{"train.rewards": f"[{base}]",
                                                                              "train.reward_weights": "null"}))
    assert proc.returncode == 2 and "is not a reward model" in proc.stderr, proc.stderr


def test_a_reward_model_from_a_reward_run_is_a_reward(tmp_path, cache_dir, base):
    """train.objective=reward's run folder as a reward function, scored in process, beside a built-in."""
    reward_model = tmp_path / "reward-model"
    run_cli("train", *tiny_overrides(reward_model, cache_dir, **{
        "model.name_or_path": base, "data.source": "builtin:pydoc-reward", "data.format": "auto", "data.seq_len": 256,
        "train.objective": "reward", "train.max_steps": 2, "train.global_batch_size": 4, "train.micro_batch_size": 2}),
        check=True)
    out = tmp_path / "grpo"
    run_cli("train", *_args(out, cache_dir, base, **{"train.rewards": f"[{reward_model}, exact_answer]",
                                                       "train.max_steps": 1, "train.eval_every": 1}), check=True)
    row = metrics_rows(out)[0]
    assert row["rewards/reward-model/mean"] != 0.0 and "rewards/exact_answer/mean" in row


def test_grpo_raises_the_reward_it_is_trained_on(tmp_path, cache_dir, base):
    """A format reward the random tiny model meets a quarter of the time (a completion opening with a
    space): 30 steps of full-weight GRPO take the mean reward of the last 5 steps well above the
    first 5's (0.26 → 0.74 when this was written)."""
    out = tmp_path / "learns"
    run_cli("train", *_args(out, cache_dir, base, **{
        "train.rewards": '["regex:^ "]', "train.reward_weights": "null", "train.num_generations": 8,
        "train.max_completion_length": 4, "train.global_batch_size": 32, "train.micro_batch_size": 32,
        "train.max_steps": 30, "train.eval_every": 30, "model.lora.enabled": "false", "train.rl_beta": 0.0,
        "train.checkpoint_every": 30}), check=True)
    rows = metrics_rows(out)
    rewards = [r["reward"] for r in rows]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.25, rewards
    # `cputrain eval`: held-out mean reward of the trained model (the run's last validation) and of
    # the model it started from, under the run's config
    after = json.loads(run_cli("eval", out, check=True).stdout)
    before = json.loads(run_cli("eval", base, out / "config.yaml", check=True).stdout)
    assert after["reward"] == rows[-1]["eval_reward"] and after["loss"] == -after["reward"]
    assert before["reward"] < after["reward"], (before, after)
