"""Every sampler and pruner a spec can name: what Optuna object it builds, that a real study (journal
storage, the spec's space) runs with it, and that unsuitable combinations are refused with the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from pydantic import ValidationError

from tunepod.hpo.study import (
    distributions,
    make_pruner,
    make_sampler,
    open_study,
    reseed_for_next_trial,
    startup_trials,
)
from tunepod.spec.models import PrunerSpec, TuneSettings

SPACE = {
    "lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
    "width": {"type": "int", "low": 8, "high": 64},
    "act": {"type": "categorical", "choices": ["relu", "tanh"]},
}


def settings(tmp_path: Path, sampler: Any, **extra: Any) -> TuneSettings:
    return TuneSettings.model_validate(
        {
            "train": {"entrypoint": "train.py"},
            "study": {"name": "s", "storage": f"journal://{tmp_path}/optuna.log", "metric": "loss"},
            "space": SPACE,
            "num_trials": 6,
            "sampler": sampler,
            "seed": 3,
            **extra,
        }
    )


@pytest.mark.parametrize(
    ("sampler", "built"),
    [
        ("tpe", optuna.samplers.TPESampler),
        ("random", optuna.samplers.RandomSampler),
        ({"kind": "gp", "n_startup_trials": 2, "deterministic_objective": True}, optuna.samplers.GPSampler),
        (
            {"kind": "cmaes", "n_startup_trials": 2, "popsize": 4, "with_margin": True},
            optuna.samplers.CmaEsSampler,
        ),
        ({"kind": "qmc", "qmc_type": "halton", "scramble": True}, optuna.samplers.QMCSampler),
        ({"kind": "nsga2", "population_size": 4}, optuna.samplers.NSGAIISampler),
    ],
)
def test_each_sampler_runs_a_study_past_its_start_up_trials(
    tmp_path: Path, sampler: Any, built: type
) -> None:
    tune = settings(tmp_path, sampler)
    study = open_study(tune)
    assert isinstance(study.sampler, built)
    space = distributions(tune.space)
    for _ in range(6):
        reseed_for_next_trial(study, tune, len(study.trials))
        trial = study.ask(space)
        study.tell(trial, trial.params["lr"] * trial.params["width"])
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 6
    # Reseeded per trial, a sampler never suggests one whole point twice (a model-based one may well
    # come back to the best corner of lr x width with the other activation).
    assert len({tuple(sorted(t.params.items())) for t in study.trials}) == 6


@pytest.mark.parametrize(
    ("sampler", "num_parallel", "expected"),
    [
        ("tpe", 1, 2),  # TPE: as many random trials as run at once, at least 2
        ("tpe", 2, 2),
        ("tpe", 8, 8),
        ({"kind": "tpe", "n_startup_trials": 10}, 2, 10),  # the spec's word wins
        ({"kind": "tpe", "n_startup_trials": 0}, 4, 0),
        ("gp", 4, 10),  # Optuna's defaults
        ("cmaes", 4, 1),
    ],
)
def test_start_up_trials_default_to_the_trials_in_flight_for_tpe(
    tmp_path: Path, sampler: Any, num_parallel: int, expected: int
) -> None:
    tune = settings(tmp_path, sampler, num_parallel=num_parallel)
    assert startup_trials(tune) == expected
    if tune.sampler.kind == "tpe":
        assert make_sampler(tune)._n_startup_trials == expected  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("sampler", "extra", "message"),
    [
        ({"kind": "tpe", "popsize": 8}, {}, "sampler.popsize applies to sampler kind cmaes, not tpe"),
        ({"kind": "random", "n_startup_trials": 5}, {}, "applies to sampler kind tpe or gp or cmaes"),
        ("annealing", {}, "Input should be 'tpe', 'random', 'gp', 'cmaes', 'qmc' or 'nsga2'"),
        (
            "cmaes",
            {"study": {"name": "s", "objectives": [{"metric": "a", "direction": "minimize"},
                                                   {"metric": "b", "direction": "maximize"}]}},
            "sampler cmaes optimizes one objective, the study has 2",
        ),
        (
            "cmaes",
            {"space": {"act": {"type": "categorical", "choices": ["relu", "tanh"]}}},
            "every parameter of space is categorical",
        ),
    ],
)  # fmt: skip
def test_unsuitable_samplers_are_refused_with_the_reason(
    tmp_path: Path, sampler: Any, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(")):
        settings(tmp_path, sampler, **extra)


def pruned(study: optuna.Study, values: list[float]) -> bool:
    """Report ``values`` step by step, asking the pruner after each report as the tuner does; whether
    it pruned; a trial it let through is told its last value."""
    trial = study.ask()
    for step, value in enumerate(values):
        trial.report(value, step)
        if study.pruner.prune(study, study.trials[trial.number]):
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            return True
    study.tell(trial, values[-1])
    return False


@pytest.mark.parametrize(
    ("pruner", "kind"),
    [
        ({"kind": "successive_halving", "min_resource": 1, "reduction_factor": 2},
         optuna.pruners.SuccessiveHalvingPruner),
        ({"kind": "threshold", "upper": 1.0}, optuna.pruners.ThresholdPruner),
        ({"kind": "wilcoxon", "p_threshold": 0.2, "warmup_steps": 1}, optuna.pruners.WilcoxonPruner),
    ],
)  # fmt: skip
def test_each_pruner_stops_a_clearly_worse_trial_and_keeps_a_good_one(
    pruner: dict[str, Any], kind: type
) -> None:
    """A minimized loss: earlier trials report ~0.5 at each step; then a trial at 5.0 and up is pruned,
    one at 0.1 is not."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize", pruner=make_pruner(PrunerSpec.model_validate(pruner)))
    assert isinstance(study.pruner, kind)
    for offset in (0.0, 0.01, 0.02):  # the first is kept; the others, a little worse, may be pruned
        pruned(study, [0.5 + offset + step * 0.001 for step in range(8)])
    assert pruned(study, [5.0 + step for step in range(8)]) is True
    assert pruned(study, [0.1] * 8) is False


@pytest.mark.parametrize(
    ("pruner", "message"),
    [
        ({"kind": "threshold"}, "pruner kind threshold needs a bound; fix: set lower, upper or both"),
        ({"kind": "median", "min_resource": 3}, "pruner.min_resource applies to pruner kind hyperband or"),
        ({"kind": "hyperband", "p_threshold": 0.05}, "pruner.p_threshold applies to pruner kind wilcoxon"),
        (
            {"kind": "successive_halving", "max_resource": 6},
            "pruner.max_resource applies to pruner kind hyperband",
        ),
        (
            {"kind": "hyperband", "min_resource": 4, "max_resource": 3},
            "pruner.max_resource 3 is below min_resource 4; fix: set max_resource to the step of a full "
            r"trial's last report \+ 1, or leave it out",
        ),
    ],
)
def test_unsuitable_pruner_options_are_refused_with_the_fix(pruner: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PrunerSpec.model_validate(pruner)


@pytest.mark.parametrize("text", ["cost < 5", "cost <= five", "<= 5", "cost <= nan"])
def test_a_constraint_that_does_not_parse_is_refused_with_its_form(tmp_path: Path, text: str) -> None:
    with pytest.raises(ValidationError, match=r"is not '<metric> <= <number>' or '<metric> >= <number>'"):
        settings(tmp_path, "tpe", constraints=[text])


def running_trial_pruned(study: optuna.Study, values: list[float]) -> bool:
    """Report ``values`` step by step and ask the pruner once, the trial left running."""
    trial = study.ask()
    for step, value in enumerate(values):
        trial.report(value, step)
    return study.pruner.prune(study, study.trials[trial.number])


@pytest.mark.parametrize(("max_resource", "prunes"), [(None, False), (6, True)])
def test_hyperband_prunes_before_any_trial_completed_only_with_max_resource(
    max_resource: int | None, prunes: bool
) -> None:
    """Unset, Hyperband sizes its brackets from the first completed trial and prunes nothing before
    (on a short budget, most of it); with ``max_resource`` the trials clearly worse than those
    running beside them are pruned from the start."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = PrunerSpec(kind="hyperband", min_resource=1, max_resource=max_resource)
    study = optuna.create_study(study_name="hyperband", direction="maximize", pruner=make_pruner(spec))
    for _ in range(3):
        running_trial_pruned(study, [0.90, 0.95])
    outcomes = [running_trial_pruned(study, [0.10, 0.12]) for _ in range(6)]
    assert any(outcomes) is prunes
    assert not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
