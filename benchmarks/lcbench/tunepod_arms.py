"""tunepod's own arms on LCBench: the real Tuner and search policy in simulated time
(``benchmarks.simulated_tuner``), each trial's epochs the surrogate's curve and epoch times.

A study here is what a spec would run: the 7 hyperparameters as its space, ``val_accuracy``
maximized, ``num_parallel`` the budget's workers, and trials asked until the budget's epochs are
trained. Every start and resume of a job costs the budget's ``startup_s``, as for every other arm;
a stopped job exits at once (the surrogate's epochs are what the budget counts, not the exit).
What differs between the arms is only the spec's sampler and policy, which is what ships.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from benchmarks.lcbench.problem import Budget, Curve, Problem, Recorder, Trace
from benchmarks.simulated_tuner import run_quality_study
from tunepod.spec.models import TuneSettings

METRIC = "val_accuracy"
# More than any budget here can train: the study ends when the budget's epochs are spent.
MAX_TRIALS = 10_000


@dataclass(frozen=True)
class LcbenchCurve:
    """A problem's surrogate as the quality run's curve model: epoch ``step + 1`` at step ``step``."""

    problem: Problem
    startup: float

    @property
    def num_steps(self) -> int:
        return self.problem.max_epochs

    @property
    def startup_s(self) -> float:
        return self.startup

    @property
    def exit_s(self) -> float:
        return 0.0

    @property
    def stop_s(self) -> float:
        return 0.0

    def value(self, params: Mapping[str, Any], step: int) -> float:
        return float(self._curve(_key(params)).val_accuracy[step])

    def step_s(self, params: Mapping[str, Any], step: int) -> float:
        time_s = self._curve(_key(params)).time_s
        return float(time_s[step] - (time_s[step - 1] if step else 0.0))

    @functools.cache  # noqa: B019 (one per problem and arm run; the surrogate is the slow part)
    def _curve(self, key: tuple[tuple[str, float], ...]) -> Curve:
        return self.problem.curve(dict(key))


def _key(params: Mapping[str, Any]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted((name, float(value)) for name, value in params.items()))


def tune_step(
    problem: Problem,
    num_parallel: int,
    seed: int,
    sampler: str,
    pruner: dict[str, Any],
    train: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The spec's tune step (its ``with``) for this arm on ``problem``: what the simulated study runs,
    and what ``agreement`` runs through `tunepod run` with ``train`` (the real training job)."""
    space = {
        p.name: {"type": "int" if p.integer else "float", "low": p.low, "high": p.high, "log": p.log}
        for p in problem.space
    }
    return {
        "train": train or {"entrypoint": "train.py"},
        "study": {"name": f"lcbench-{problem.instance}", "metric": METRIC, "direction": "maximize"},
        "space": space,
        "num_trials": MAX_TRIALS,
        "num_parallel": num_parallel,
        "sampler": sampler,
        "pruner": pruner,
        "seed": seed,
    }


def settings(
    problem: Problem, budget: Budget, seed: int, sampler: str, pruner: dict[str, Any]
) -> TuneSettings:
    return TuneSettings.model_validate(tune_step(problem, budget.n_workers, seed, sampler, pruner))


def study(problem: Problem, seed: int, budget: Budget, sampler: str, pruner: dict[str, Any]) -> Trace:
    """The arm's study until the budget's epochs are trained, as the benchmark's trace."""
    run = run_quality_study(
        settings(problem, budget, seed, sampler, pruner),
        LcbenchCurve(problem, budget.startup_s),
        seed=seed,
        num_parallel=budget.n_workers,
        budget_steps=budget.total_epochs,
    )
    recorder = Recorder(budget)
    for report in run.reports:
        if not recorder.record(report.at_s, report.value):
            break
    end_s = recorder.time_s[-1] if recorder.time_s else run.simulated_s
    return recorder.trace(end_s, num_trials=len(run.outcomes), num_jobs=len(run.jobs))


def _asha(problem: Problem, **options: Any) -> dict[str, Any]:
    return {"kind": "asha", "max_resource": problem.max_epochs, **options}


POLICIES: dict[str, Callable[[Problem], tuple[str, dict[str, Any]]]] = {
    # TPE, ASHA with its default rungs (the first at a third of a trial), ranking at each rung by the
    # value there: the recommended setting until the development instances chose forecasts.
    "tunepod-asha": lambda problem: ("tpe", _asha(problem, rank_by="value")),
    # The recommended setting: as above, ranking at each rung (and the paused trials for promotion)
    # by the final value each trial's curve up to the rung forecasts.
    "tunepod-asha-forecast": lambda problem: ("tpe", _asha(problem, rank_by="forecast")),
    # TPE, ASHA with the peers' rungs: the first at epoch 1, a factor of 3.
    "tunepod-asha-epoch-1": lambda problem: ("tpe", _asha(problem, min_resource=1, rank_by="value")),
    # TPE, every trial trained to its end: what the policies add over the sampler alone.
    "tunepod-tpe": lambda problem: ("tpe", {"kind": "none"}),
}
"""Each arm's sampler and pruner spec, by the arm's name in ``arms.ARMS``."""


def arm(name: str) -> Callable[[Problem, int, Budget], Trace]:
    """The arm ``name`` of ``POLICIES``: its study on a problem, for a seed and budget."""

    def run(problem: Problem, seed: int, budget: Budget) -> Trace:
        sampler, pruner = POLICIES[name](problem)
        return study(problem, seed, budget, sampler, pruner)

    run.__name__ = run.__qualname__ = name.replace("-", "_")
    return run
