"""The preference losses against hand computations, their global-batch mean independent of the
split, and the refusals of an objective that does not fit the data or the weights."""

from __future__ import annotations

import math

import pytest
import torch

from cputrain.objectives.preference import SimpoObjective
from cputrain.objectives.preference_loss import dpo_losses, sequence_logps, simpo_losses
from harness.run_cli_here import run_cli_here
from harness.tiny_run import tiny_overrides


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_dpo_at_the_reference_is_ln2_and_matches_the_formula():
    same = torch.tensor([-12.0, -3.5])
    at_ref = dpo_losses(same, same - 1, same, same - 1, beta=0.1)
    assert torch.allclose(at_ref.losses, torch.full((2,), math.log(2)))
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-10 * torch.rand(5, generator=g, dtype=torch.float64) for _ in range(4))
    beta, ls = 0.3, 0.1
    out = dpo_losses(pc, pr, rc, rr, beta, ls)
    for i in range(5):
        margin = (pc[i] - pr[i] - (rc[i] - rr[i])).item()
        hand = -math.log(_sigmoid(beta * margin)) * (1 - ls) - math.log(_sigmoid(-beta * margin)) * ls
        assert out.losses[i].item() == pytest.approx(hand, abs=1e-12)
        assert out.chosen_rewards[i].item() == pytest.approx(beta * (pc[i] - rc[i]).item())
        assert out.rejected_rewards[i].item() == pytest.approx(beta * (pr[i] - rr[i]).item())
    sums = out.stat_sums()  # rewards/chosen, rejected, accuracies, margins, logps/chosen, rejected
    assert sums[2].item() == float((out.chosen_rewards > out.rejected_rewards).sum())
    assert sums[3].item() == pytest.approx((out.chosen_rewards - out.rejected_rewards).sum().item())


def test_simpo_matches_the_formula():
    c, r = torch.tensor([-1.2, -0.4], dtype=torch.float64), torch.tensor([-1.0, -2.0], dtype=torch.float64)
    out = simpo_losses(c, r, beta=2.0, gamma=0.5)
    for i in range(2):
        hand = -math.log(_sigmoid(2.0 * (c[i] - r[i]).item() - 0.5))
        assert out.losses[i].item() == pytest.approx(hand, abs=1e-12)
    assert torch.allclose(out.chosen_rewards, 2.0 * c)


def test_sequence_logps_sum_each_sequences_trained_targets():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 6, 5, generator=g)
    labels = torch.tensor([[-100, 2, 3, -100, 4, -100]])
    seq = torch.tensor([[0, 0, 0, 1, 1, -1]])
    sums, counts = sequence_logps(logits, labels, seq, 2)
    logp = torch.log_softmax(logits[0], -1)
    assert torch.allclose(sums, torch.stack([logp[0, 2] + logp[1, 3], logp[3, 4]]))
    assert counts.tolist() == [2, 1]


class _Batch:
    """Two sequences per pair in one row each; logits are given, not computed."""

    def __init__(self, logits, labels, seq):
        self.logits, self.labels, self.sequence_ids = logits, labels, seq

    @property
    def pairs(self):
        return (int(self.sequence_ids.max()) + 1) // 2

    def model_inputs(self, model=None):
        return {"input_ids": None, "labels": self.labels, "logits": self.logits}


class _Model:
    def __call__(self, input_ids=None, logits=None, **_):
        return type("Out", (), {"logits": logits})()


class _Train:
    objective, dpo_beta, dpo_label_smoothing, simpo_beta, simpo_gamma = "simpo", 0.1, 0.0, 2.0, 0.5


def test_the_global_batch_mean_is_independent_of_the_split():
    g = torch.Generator().manual_seed(2)
    pairs = 6
    logits = torch.randn(pairs, 8, 7, generator=g)
    labels = torch.randint(0, 7, (pairs, 8), generator=g)
    labels[:, 0] = -100
    seq = torch.tensor([[0] * 4 + [1] * 4])  # chosen, then rejected, in one row
    objective = SimpoObjective(_Train(), reference=None)

    def step_loss(micro: int, world: int) -> float:
        """The mean over ranks (strategies average gradients so) of each rank's summed micro-batch losses."""
        ranks = []
        for shard in torch.arange(pairs).chunk(world):
            total = 0.0
            for part in shard.split(micro):
                batch = _Batch(logits[part], labels[part], (seq + 2 * torch.arange(len(part))[:, None]).clone())
                total += objective.loss(_Model(), batch, pairs / world)[0].item()
            ranks.append(total)
        return sum(ranks) / world

    one = step_loss(pairs, 1)
    every = simpo_losses(*(lambda s, n: ((s / n)[0::2], (s / n)[1::2]))(*sequence_logps(
        logits, labels, (seq + 2 * torch.arange(pairs)[:, None]), 2 * pairs)), beta=2.0, gamma=0.5).losses
    assert one == pytest.approx(every.mean().item(), abs=1e-6)
    for micro, world in ((1, 1), (2, 1), (1, 2), (3, 2), (1, 3)):
        assert step_loss(micro, world) == pytest.approx(one, abs=1e-6), (micro, world)


@pytest.mark.parametrize("extra, expect", [
    ({"train.objective": "dpo"}, "trains on preference pairs, but data.format is text"),
    ({"data.source": "builtin:pydoc-dpo", "data.format": "auto"}, "set train.objective=dpo or simpo"),
    ({"data.source": "builtin:pydoc-sft", "data.format": "auto", "train.objective": "simpo"},
     "but data.format is chat"),
])
def test_an_objective_that_does_not_fit_is_refused_in_one_line(tmp_path, extra, expect):
    proc = run_cli_here("train", *tiny_overrides(tmp_path / "run", tmp_path / "cache", **extra))
    assert proc.returncode != 0 and expect in proc.stderr, proc.stderr
    # one error line; before it at most the logged reason the objective set the data's format with
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and lines[-1].startswith("cputrain: error:"), proc.stderr
    assert all(" auto: data.format = " in line for line in lines[:-1]), proc.stderr


def test_a_resumed_run_keeps_its_objective_and_an_older_folder_resumes_as_lm(tmp_path):
    import yaml

    from cputrain.config import Config
    from cputrain.errors import RunFolderError
    from cputrain.run_folder.layout import RunFolder
    from cputrain.run_folder.run_config import check_compatible, write_run_config

    run = RunFolder(str(tmp_path / "run"))
    dpo = Config.model_validate({"data": {"source": "p.jsonl", "format": "preference"},
                                 "train": {"objective": "dpo"}})
    write_run_config(run, dpo, [])
    run.fs.makedirs(run.step_path(4), exist_ok=True)
    run.write_text("{}", "checkpoints", "step-000004", "trainer_state.json")
    check_compatible(run, dpo)
    for key, value in (("objective", "simpo"), ("dpo_beta", 0.2)):
        changed = Config.model_validate({**dpo.model_dump(), "train": {**dpo.train.model_dump(), key: value}})
        with pytest.raises(RunFolderError, match=f"another run \\(train.{key}: "):
            check_compatible(run, changed)
    # a config.yaml written before these keys existed: its run trained the language-model loss
    lm = Config()
    recorded = yaml.safe_load(lm.dump_yaml())
    for section, key in (("train", "objective"), ("train", "dpo_beta"), ("train", "dpo_label_smoothing"),
                         ("train", "simpo_beta"), ("train", "simpo_gamma"), ("data", "chosen_field"),
                         ("data", "rejected_field")):
        del recorded[section][key]
    run.write_text(yaml.safe_dump(recorded), "config.yaml")
    check_compatible(run, lm)
