"""train.objective → the objective that answers for it (objectives.contract says what each is
asked). A new objective is its module and one entry here."""

from __future__ import annotations

from cputrain.objectives.contract import Objective, Reference
from cputrain.objectives.kto import KtoObjective
from cputrain.objectives.lm import LmObjective
from cputrain.objectives.online_rl import GrpoObjective, RlooObjective
from cputrain.objectives.preference import DpoObjective, SimpoObjective
from cputrain.objectives.reward import RewardObjective

OBJECTIVES: dict[str, type[Objective]] = {
    cls.name: cls for cls in (LmObjective, DpoObjective, SimpoObjective, KtoObjective, RewardObjective,
                             GrpoObjective, RlooObjective)
}


def objective_class(name: str) -> type[Objective]:
    """The class of train.objective=`name`: its facts, before any model exists (preflight, the plans)."""
    return OBJECTIVES[name]


def objective_for(train_cfg, reference: Reference = None, chunked: bool = False) -> Objective:
    """The run's objective; `reference(model)` is the converter's context in which `model` is the
    reference; `chunked`: model.chunked_loss installed the block-wise head (kernels/chunked_loss)."""
    return OBJECTIVES[train_cfg.objective](train_cfg, reference, chunked)
