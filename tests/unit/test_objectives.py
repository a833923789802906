"""The objectives as a family: the registry, the facts preflight and the plans read from a class
before any model exists, the config rules each objective makes, and KTO's data format under its
name (feedback) and its former one (unpaired)."""

from __future__ import annotations

import pytest
import yaml

from cputrain.config import Config
from cputrain.config.file import load_config
from cputrain.errors import ConfigError
from cputrain.objectives.contract import Objective
from cputrain.objectives.objective import OBJECTIVES, objective_class, objective_for


def test_every_train_objective_has_a_class_of_the_contract():
    names = Config.model_fields["train"].annotation.model_fields["objective"].annotation.__args__
    assert set(OBJECTIVES) == set(names)
    for name, cls in OBJECTIVES.items():
        assert issubclass(cls, Objective) and cls.name == name
        assert objective_for(Config(train={"objective": name}).train).name == name  # builds without a model


def test_the_facts_the_plans_and_preflight_read_before_any_model():
    """What the tables DATA_OF, HEAD_OF and EXTRA_FORWARDS said, now each objective's own."""
    facts = {name: (cls.data_format, cls.head, cls.extra_forwards, cls.stores_reference)
             for name, cls in OBJECTIVES.items()}
    assert facts == {"lm": ("text", "lm", 0, False), "dpo": ("preference", "lm", 0, True),
                     "simpo": ("preference", "lm", 0, False), "kto": ("feedback", "lm", 1, True),
                     "reward": ("preference", "score", 0, False), "grpo": ("prompt", "lm", 0, False),
                     "rloo": ("prompt", "lm", 0, False)}
    assert [name for name, cls in OBJECTIVES.items() if cls.perplexity] == ["lm"]
    assert [name for name, cls in OBJECTIVES.items() if not cls.summary_figures] == ["lm"]


@pytest.mark.parametrize("overrides, expect", [
    (["train.objective=reward", "model.chunked_loss=true"], "model.chunked_loss=true cuts a vocabulary head's"),
    (["train.objective=reward", "parallel.strategy=zero3"], "parallel.strategy=zero3 does not train a reward model"),
    (["train.objective=reward", "parallel.strategy=fsdp"], "a reward model from random weights does not take"),
    (["data.packing=false", "train.global_batch_pairs=8"], "train.objective=lm trains no pairs"),
    (["train.objective=grpo", "train.rewards=[exact_answer]", "train.global_batch_size=12"],
     r"must be a multiple of train.num_generations \(8\), each prompt's group whole; set train.global_batch_size=16"),
    (["train.objective=rloo"], "needs at least one reward function"),
    (["train.objective=grpo", "train.rewards=[exact_answer]", "train.reward_weights=[1.0,2.0]"],
     "has 2 weight"),
    (["train.objective=grpo", "train.rewards=[exact_answer]", "data.seq_len=256"],
     r"data.seq_len \(256\) leaves no room for a prompt"),
])
def test_an_objective_refuses_a_config_it_cannot_train_under(overrides, expect):
    cfg = load_config(None, overrides)  # the config alone is valid: the objective refuses it
    with pytest.raises(ConfigError, match=expect):
        objective_class(cfg.train.objective).check_config(cfg)


def test_a_fitting_config_passes_the_objective_rules():
    for overrides in (["train.objective=reward"], ["train.objective=dpo", "data.packing=false",
                                                   "train.global_batch_pairs=8"]):
        cfg = load_config(None, overrides)
        objective_class(cfg.train.objective).check_config(cfg)


def test_unpaired_is_read_as_feedback_in_a_config():
    assert load_config(None, ["data.format=unpaired", "train.objective=kto"]).data.format == "feedback"
    assert load_config(None, ["data.format=feedback"]).data.format == "feedback"


def test_a_run_folder_recorded_with_unpaired_resumes_under_feedback(tmp_path):
    from cputrain.run_folder.layout import RunFolder
    from cputrain.run_folder.run_config import check_compatible

    run = RunFolder(str(tmp_path / "run"))
    kto = Config.model_validate({"data": {"source": "f.jsonl", "format": "feedback"}, "train": {"objective": "kto"}})
    recorded = yaml.safe_load(kto.dump_yaml())
    recorded["data"]["format"] = "unpaired"  # as a run before the rename wrote it
    run.write_text(yaml.safe_dump(recorded), "config.yaml")
    run.fs.makedirs(run.step_path(4), exist_ok=True)
    run.write_text("{}", "checkpoints", "step-000004", "trainer_state.json")
    check_compatible(run, kto)
    assert Config.model_validate(recorded).data.format == "feedback"  # read back by a resuming rank
