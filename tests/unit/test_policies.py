"""The search-policy contract: the tuning loop names no policy, and the spec picks the policy."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import optuna
import pytest

from tunepod.hpo.policies import PolicyContext, SearchPolicy, make_policy
from tunepod.hpo.policies.asha import AshaPolicy
from tunepod.hpo.policies.contract import SlotView, StudyState
from tunepod.hpo.policies.pbt import PbtPolicy
from tunepod.hpo.policies.pruner import OptunaPruning
from tunepod.hpo.study import distributions
from tunepod.hpo.trials import StudyTrials
from tunepod.spec.models import TuneSettings

TUNER = Path(__file__).resolve().parents[2] / "tunepod" / "hpo" / "tuner.py"


def test_the_tuning_loop_names_no_search_policy() -> None:
    named = re.findall(r"asha|pbt|population|exploit|promot", TUNER.read_text(), re.IGNORECASE)
    assert not named, f"tunepod/hpo/tuner.py names a policy: {sorted(set(named))}"


def tune_settings(**overrides: Any) -> TuneSettings:
    raw: dict[str, Any] = {
        "train": {"entrypoint": "train.py"},
        "study": {"name": "s", "metric": "score"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "num_trials": 4,
        "num_parallel": 4,
    }
    return TuneSettings.model_validate(raw | overrides)


def policy_of(settings: TuneSettings, tmp_path: Path) -> SearchPolicy:
    study = optuna.create_study(direction="maximize")
    return make_policy(
        PolicyContext(
            settings=settings,
            trials=StudyTrials(study),
            jobs_dir=tmp_path,
            job_dir=lambda trial: tmp_path / f"trial-{trial.number}",
            distributions=distributions(settings.space),
            job_writes_job_dir=True,
            launcher="local",
        )
    )


@pytest.mark.parametrize(
    ("overrides", "kind"),
    [
        ({}, SearchPolicy),
        ({"pruner": {"kind": "median"}}, OptunaPruning),
        ({"pruner": {"kind": "asha", "max_resource": 9}}, AshaPolicy),
        ({"pbt": {"population": 4, "interval": 2}}, PbtPolicy),
    ],
)
def test_the_spec_picks_the_policy(overrides: dict[str, Any], kind: type, tmp_path: Path) -> None:
    assert type(policy_of(tune_settings(**overrides), tmp_path)) is kind


def _no_trials() -> StudyState:
    return StudyState(unfinished=[], num_finished=0, read_trials=list)


def test_room_is_what_the_walk_over_every_trial_left_to_ask_for(tmp_path: Path) -> None:
    policy = policy_of(tune_settings(num_trials=10), tmp_path)
    study = policy.trials.study
    for _ in range(3):
        study.tell(study.ask(), 1.0)
    study.tell(study.ask(), state=optuna.trial.TrialState.PRUNED)
    study.ask()
    study.enqueue_trial({"x": 0.5})
    tally = policy.trials.tally()
    state = StudyState(tally.unfinished, sum(tally.finished.values()), read_trials=study.get_trials)
    walked = sum(t.state.is_finished() or t.state is optuna.trial.TrialState.RUNNING for t in study.trials)
    assert policy.room(state) == 10 - walked == 5


def test_without_a_policy_free_slots_ask_for_the_trials_still_to_ask_for(tmp_path: Path) -> None:
    policy = policy_of(tune_settings(), tmp_path)
    assert policy.plan(SlotView(_no_trials(), frozenset(), capacity=3, room=2)).ask == 2
    assert policy.plan(SlotView(_no_trials(), frozenset(), capacity=0, room=2)).ask == 0
    assert policy.judge(optuna.trial.create_trial(value=1.0)) is None
