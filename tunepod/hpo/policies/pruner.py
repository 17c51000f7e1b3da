"""Optuna's pruners as a search policy: a job is stopped when the study's pruner says
``should_prune``, and its trial ends PRUNED (Optuna's pruners can only kill). The pruner itself is
the study's (``tunepod.hpo.study.make_pruner``) and keeps no state of its own beyond Optuna's."""

from __future__ import annotations

from optuna.trial import FrozenTrial

from tunepod.hpo.policies.contract import JobJudge, SearchPolicy, Told
from tunepod.hpo.trials import retried

PRUNED = "pruned"


class OptunaPruning(SearchPolicy):
    """Stop a job when the study's Optuna pruner says so."""

    name = "pruner"

    def judge(self, trial: FrozenTrial) -> JobJudge:
        return _ShouldPrune()


class _ShouldPrune:
    def judge(self, told: Told) -> str | None:
        return PRUNED if retried(told.live().should_prune) else None
