"""The arms that need nothing but numpy and Optuna: random search and plain Optuna (TPE + Hyperband)."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.lcbench.problem import Budget, Problem, Trace
from benchmarks.lcbench.simulator import Job, simulate
from benchmarks.lcbench.surrogate import Param

REDUCTION_FACTOR = 3
MIN_EPOCHS = 1


class RandomSearch:
    """Every trial a uniform draw trained for all its epochs (the baseline)."""

    def __init__(self, problem: Problem, seed: int) -> None:
        self.problem = problem
        self.rng = np.random.default_rng(seed)
        self.trials = 0

    def next_job(self) -> Job:
        (config,) = self.problem.sample(self.rng)
        self.trials += 1
        return Job(self.trials, config, 1, self.problem.max_epochs)

    def on_epoch(self, job: Job, epoch: int, value: float) -> bool:
        return True


def random_search(problem: Problem, seed: int, budget: Budget) -> Trace:
    return simulate(problem, budget, RandomSearch(problem, seed))


def suggest(trial: Any, param: Param) -> float:
    """``param`` drawn through an Optuna trial."""
    if param.integer:
        return float(trial.suggest_int(param.name, int(param.low), int(param.high), log=param.log))
    return float(trial.suggest_float(param.name, param.low, param.high, log=param.log))


class OptunaAskTell:
    """An Optuna study driven by ask and tell: a trial reports every epoch and stops when its pruner
    says so (a pruned trial is killed; Optuna cannot resume it)."""

    def __init__(self, problem: Problem, study: Any) -> None:
        self.problem = problem
        self.study = study
        self.trials: dict[int, Any] = {}

    def next_job(self) -> Job:
        trial = self.study.ask()
        self.trials[trial.number] = trial
        config = {param.name: suggest(trial, param) for param in self.problem.space}
        return Job(trial.number, config, 1, self.problem.max_epochs)

    def on_epoch(self, job: Job, epoch: int, value: float) -> bool:
        import optuna

        trial = self.trials[job.trial]
        trial.report(value, epoch)
        if epoch == job.last_epoch:
            self.study.tell(trial, value)
            return False
        if trial.should_prune():
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            return False
        return True


def optuna_tpe_hyperband(problem: Problem, seed: int, budget: Budget) -> Trace:
    """Plain Optuna at its defaults (TPESampler: 10 random start-up trials, independent sampling) with
    HyperbandPruner(min_resource=1, max_resource=52, reduction_factor=3). Not tunepod's arm."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # A fixed study name: Hyperband assigns trials to brackets by a hash of the study's name and the
    # trial's number, and the default name is a fresh UUID, which would make seeds irreproducible.
    study = optuna.create_study(
        study_name=f"lcbench-{problem.instance}-seed-{seed}",
        direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=seed),
        pruner=optuna.pruners.HyperbandPruner(
            min_resource=MIN_EPOCHS, max_resource=problem.max_epochs, reduction_factor=REDUCTION_FACTOR
        ),
    )
    return simulate(problem, budget, OptunaAskTell(problem, study))
