"""Multi-objective studies: the Pareto front of a trial set, the order the steps downstream take its
trials in, and a study reopened with other objectives than it was created with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from tunepod.errors import TunepodError
from tunepod.hpo.study import make_sampler, open_study
from tunepod.outputs import Dataset, Goal, TrialOutcome, TrialRecord, TrialSet
from tunepod.spec.models import TuneSettings

PERPLEXITY = Goal(metric="perplexity", direction="minimize")
THROUGHPUT = Goal(metric="tokens_per_s", direction="maximize")


def trial(
    number: int, perplexity: float, tokens_per_s: float, outcome: TrialOutcome = "COMPLETE"
) -> TrialRecord:
    values = {"perplexity": perplexity, "tokens_per_s": tokens_per_s} if outcome == "COMPLETE" else {}
    return TrialRecord(
        number=number,
        outcome=outcome,
        params={},
        value=values.get("perplexity"),
        values=values,
        job_dir=f"/jobs/trial-{number}",
        checkpoint_dir=f"/jobs/trial-{number}/checkpoints",
    )


def trial_set(*trials: TrialRecord) -> TrialSet:
    dataset = Dataset(source="s", path="/d", num_files=0, num_bytes=0, copied_files=0, copied_bytes=0)
    return TrialSet(
        step="search",
        study="s",
        metric="perplexity",
        direction="minimize",
        dataset=dataset,
        trials=list(trials),
        objectives=[PERPLEXITY, THROUGHPUT],
    )


def test_the_front_holds_the_trials_nothing_dominates() -> None:
    trials = trial_set(
        trial(0, perplexity=10.0, tokens_per_s=100.0),  # fastest
        trial(1, perplexity=5.0, tokens_per_s=50.0),  # best perplexity
        trial(2, perplexity=8.0, tokens_per_s=80.0),  # a trade-off: on the front
        trial(3, perplexity=9.0, tokens_per_s=70.0),  # worse than 2 in both
        trial(4, perplexity=5.0, tokens_per_s=40.0),  # as good as 1 in perplexity, slower
        trial(5, perplexity=1.0, tokens_per_s=1000.0, outcome="PRUNED"),  # not completed: never on it
    )
    assert [t.number for t in trials.pareto_front()] == [0, 1, 2]


def test_best_takes_the_front_first_by_the_primary_objective() -> None:
    trials = trial_set(
        trial(0, perplexity=10.0, tokens_per_s=100.0),
        trial(1, perplexity=6.0, tokens_per_s=10.0),
        trial(2, perplexity=7.0, tokens_per_s=5.0),  # dominated by 1, but better perplexity than 0
    )
    assert [t.number for t in trials.best(3)] == [1, 0, 2]


def test_identical_trials_are_both_on_the_front() -> None:
    trials = trial_set(trial(0, 5.0, 50.0), trial(1, 5.0, 50.0))
    assert [t.number for t in trials.pareto_front()] == [0, 1]


def settings(tmp_path: Path, study: dict[str, Any], sampler: str = "tpe") -> TuneSettings:
    return TuneSettings.model_validate(
        {
            "train": {"entrypoint": "train.py"},
            "study": {"name": "layouts", "storage": f"journal://{tmp_path}/optuna.log", **study},
            "space": {"lr": {"type": "float", "low": 0.001, "high": 0.1}},
            "num_trials": 2,
            "sampler": sampler,
        }
    )


def test_reopening_a_study_with_other_objectives_is_refused_with_what_it_holds(tmp_path: Path) -> None:
    open_study(settings(tmp_path, {"metric": "perplexity", "direction": "minimize"}))
    two = {
        "objectives": [
            {"metric": "perplexity", "direction": "minimize"},
            {"metric": "t", "direction": "maximize"},
        ]
    }
    with pytest.raises(TunepodError) as raised:
        open_study(settings(tmp_path, two))
    message = str(raised.value)
    assert "was created to minimize (1 objective(s))" in message
    assert "declare 1 objective(s) with these directions: minimize" in message


def test_a_two_objective_study_is_created_with_both_directions(tmp_path: Path) -> None:
    two = {
        "objectives": [
            {"metric": "perplexity", "direction": "minimize"},
            {"metric": "t", "direction": "maximize"},
        ]
    }
    tune = settings(tmp_path, two, sampler="nsga2")
    assert (tune.study.metric, tune.study.direction) == ("perplexity", "minimize")
    study = open_study(tune)
    assert study.directions == [optuna.study.StudyDirection.MINIMIZE, optuna.study.StudyDirection.MAXIMIZE]
    assert isinstance(make_sampler(tune), optuna.samplers.NSGAIISampler)
