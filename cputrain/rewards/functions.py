"""train.rewards made into callables, once, before any work: a built-in, a reward model's folder or
a `module:function`; then called on each step's completions as TRL calls them, their output checked
(one value a completion, each a finite number) and refused in one line naming the function and the
record."""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from cputrain.errors import ConfigError, UserError
from cputrain.rewards.builtin import exact_answer, regex_reward, starts_with_answer


class RewardError(UserError):
    """A reward function that failed on a step's completions, or returned what is not a reward."""


def _imported(spec: str):
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # any import failure is the user's module's: say which, in one line
        raise ConfigError(f"train.rewards: cannot import module '{module_name}' for '{spec}': "
                          f"{type(err).__name__}: {err}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"train.rewards: module '{module_name}' has no function '{attribute}' ('{spec}')")
    return function


BUILTIN = {"exact_answer": exact_answer, "starts_with_answer": starts_with_answer}


def reward_function(spec: str):
    """(its logged name, the callable) of one entry of train.rewards."""
    if spec in BUILTIN:
        return spec, BUILTIN[spec]
    if spec.startswith("regex:"):
        return spec, regex_reward(spec[len("regex:"):])
    if Path(spec).is_dir():
        from cputrain.rewards.reward_model import reward_model_function

        return Path(spec).name or spec, reward_model_function(spec)
    if ":" in spec:
        return spec.split(":", 1)[1], _imported(spec)
    raise ConfigError(f"train.rewards: '{spec}' is none of {', '.join(BUILTIN)}, regex:<pattern>, a reward model's "
                      "folder (no such folder) or module:function")


@dataclass
class RewardFunctions:
    """The run's reward functions: names (rewards/<name>/mean), weights, and the tokenizer that
    turns completion ids into the text they are handed."""

    names: list[str]
    functions: list
    weights: list[float]
    tokenizer: object

    def score(self, records, completion_ids: list[list[int]]) -> torch.Tensor:
        """[completions, functions]: each function called once on every completion, with the prompts,
        the completions as text (conversational prompts: as an assistant message), their ids and
        every other column of the records as lists."""
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [r.prompt for r in records]
        completions = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
                       for p, t in zip(prompts, texts)]
        columns = {key: [r.columns.get(key) for r in records] for key in (records[0].columns if records else {})}
        out = torch.zeros(len(records), len(self.functions), dtype=torch.float64)
        for f, (name, function) in enumerate(zip(self.names, self.functions)):
            try:
                values = function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            except KeyError as err:
                raise RewardError(f"reward function {name} asked for column {err} that the prompts do not have "
                                  f"(they have: {', '.join(sorted(columns)) or 'none'})") from None
            except Exception as err:
                raise RewardError(f"reward function {name} raised {type(err).__name__}: {err} (on the completions "
                                  f"of prompt {prompts[0]!r} and others)") from None
            out[:, f] = torch.as_tensor(self._checked(name, values, records, texts), dtype=torch.float64)
        return out

    @staticmethod
    def _checked(name: str, values, records, texts) -> list[float]:
        if not isinstance(values, (list, tuple)) or len(values) != len(records):
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(f"reward function {name} returned {count} value(s) for {len(records)} completions; "
                              "it must return one number per completion")
        for i, value in enumerate(values):
            bad = value is None or not isinstance(value, (int, float)) or not math.isfinite(float(value))
            if bad:
                raise RewardError(f"reward function {name} returned {value!r} for completion {i} (prompt "
                                  f"{records[i].prompt!r}, completion {texts[i]!r}); it must return a finite number")
        return [float(v) for v in values]


def build_rewards(train_cfg, tokenizer) -> RewardFunctions:
    """train.rewards built, every entry checked (imported, found) before any work."""
    built = [reward_function(spec) for spec in train_cfg.rewards]
    weights = list(train_cfg.reward_weights) if train_cfg.reward_weights is not None else [1.0] * len(built)
    return RewardFunctions([n for n, _ in built], [f for _, f in built], weights, tokenizer)
