"""The reward functions of online RL: built-ins, a `module:function` with TRL's signature handed the
prompts' other columns as lists, and each way a reward function or its output is refused in one
line naming the function and the record; a prompt that leaves no room to sample, and groups that do
not divide among the ranks, refused before the model is built."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cputrain.data.prompts.rows import PromptRecord, PromptRows
from cputrain.errors import ConfigError
from cputrain.objectives.online_rl import GrpoObjective
from cputrain.rewards.functions import RewardError, RewardFunctions, build_rewards, reward_function


class _Tok:
    eos_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(96 + i) for i in row if i) for row in ids]


RECORDS = [PromptRecord([5, 6], "Topic: def", {"answer": "def"}), PromptRecord([5, 7], "Topic: if", {"answer": "if"})]
COMPLETIONS = [[4, 5, 6], [1, 2]]  # "def", "ab"


def _rewards(*specs, weights=None) -> RewardFunctions:
    return build_rewards(SimpleNamespace(rewards=list(specs), reward_weights=weights), _Tok())


def test_built_ins_score_the_completions_text_against_the_records_columns():
    scores = _rewards("exact_answer", "starts_with_answer", "regex:^d").score(RECORDS, COMPLETIONS)
    assert scores.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]


def test_a_module_function_gets_trls_arguments(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def lengths(prompts, completions, completion_ids, answer, **kwargs):\n"
        "    assert prompts == ['Topic: def', 'Topic: if'] and answer == ['def', 'if']\n"
        "    return [float(len(c)) for c in completion_ids]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = _rewards("my_rewards:lengths", weights=[0.5])
    assert rewards.names == ["lengths"] and rewards.weights == [0.5]
    assert rewards.score(RECORDS, COMPLETIONS).tolist() == [[3.0], [2.0]]


@pytest.mark.parametrize("spec, expect", [
    ("no_such_module_here:f", "train.rewards: cannot import module 'no_such_module_here'"),
    ("json:no_such_function", "module 'json' has no function 'no_such_function'"),
    ("nonsense", "is none of exact_answer, starts_with_answer, regex:<pattern>"),
])
def test_a_reward_that_cannot_be_built_is_refused_in_one_line(spec, expect):
    with pytest.raises(ConfigError, match=expect):
        reward_function(spec)


def test_a_folder_that_holds_no_reward_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="is not a reward model"):
        reward_function(str(tmp_path))


@pytest.mark.parametrize("body, expect", [
    ("raise ValueError('boom')", r"reward function bad raised ValueError: boom \(on the completions of prompt"),
    ("return [1.0]", "returned 1 value\\(s\\) for 2 completions"),
    ("return [1.0, None]", r"returned None for completion 1 \(prompt 'Topic: if', completion 'ab'\)"),
    ("return [float('nan'), 1.0]", r"returned nan for completion 0 \(prompt 'Topic: def'"),
    ("return [1.0, kwargs['missing']]", "asked for column 'missing' that the prompts do not have"),
])
def test_a_reward_that_fails_or_returns_no_number_is_named_with_the_record(tmp_path, monkeypatch, body, expect):
    module = f"bad_rewards_{abs(hash(body))}"  # a module of its own: imports are cached by name
    (tmp_path / f"{module}.py").write_text(f"def bad(prompts, completions, **kwargs):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=expect):
        _rewards(f"{module}:bad").score(RECORDS, COMPLETIONS)


def _prompt_rows(lengths) -> PromptRows:
    ids = np.arange(sum(lengths), dtype=np.uint32)
    return PromptRows(ids, np.zeros_like(ids, dtype=np.uint8), np.asarray(lengths, dtype=np.uint32), 64, False, 0)


def _objective(**cfg) -> GrpoObjective:
    base = dict(num_generations=4, max_completion_length=48, global_batch_size=16)
    return GrpoObjective(SimpleNamespace(**{**base, **cfg}))


def test_a_prompt_that_leaves_no_room_to_sample_is_refused_before_the_model():
    with pytest.raises(ConfigError, match=r"training prompt 1 has 20 tokens, more than data.seq_len \(64\) − "
                                          r"train.max_completion_length \(48\) = 16"):
        _objective().check_rows([_prompt_rows([10, 20, 5]), _prompt_rows([3])], 1)
    _objective().check_rows([_prompt_rows([10, 16]), _prompt_rows([3])], 1)


def test_groups_that_do_not_divide_among_the_ranks_are_refused():
    with pytest.raises(ConfigError, match="a step's 4 prompts .* do not divide among 3 ranks"):
        _objective(max_completion_length=8).check_rows([_prompt_rows([4]), _prompt_rows([])], 3)


def test_advantages_of_a_step_are_taken_per_group_and_figures_name_each_reward():
    objective = _objective(max_completion_length=8, scale_rewards="none", temperature=1.0, num_iterations=1,
                           rl_beta=0.0, loss_type="dapo")
    objective.rewards = _rewards("exact_answer", "regex:^d", weights=[1.0, 2.0])
    scores = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]] * 2)
    rewards = objective.advantages((scores * torch.tensor([1.0, 2.0])).sum(1))
    assert rewards.tolist() == [1.75, -1.25, 0.75, -1.25] * 2  # weighted 3, 0, 2, 0 less their mean
    figures = objective._reward_figures(scores, torch.tensor([1.0, 2.0]), [[1]] * 8, [True] * 8, [], None)
    assert figures["rewards/exact_answer/mean"] == 0.25 and figures["rewards/regex:^d/mean"] == 0.5
    assert figures["reward"] == 1.25 and figures["frac_reward_zero_std"] == 0.0
