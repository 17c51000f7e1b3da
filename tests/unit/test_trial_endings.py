"""How a trial ended, as people read it: each ending named apart, with the step and the reason."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from tunepod.hpo.asha import ATTR_ASHA, AshaState
from tunepod.hpo.endings import ENDING_NAMES, ending_line, ending_of, why_ended
from tunepod.hpo.population import ATTR_CONTINUED_IN
from tunepod.outputs import TrialRecord


def trial(state: TrialState, curve: dict[int, float], **attrs: object) -> FrozenTrial:
    """A trial of a real in-memory study, told ``state`` after reporting ``curve``."""
    study = optuna.create_study(direction="maximize")
    study.add_trial(
        create_trial(
            state=state,
            value=max(curve.values()) if state is TrialState.COMPLETE else None,
            params={"lr": 0.1},
            distributions={"lr": FloatDistribution(1e-4, 1.0)},
            intermediate_values=curve,
            user_attrs=attrs,
        )
    )
    return study.trials[-1]


def test_a_pruned_trial_says_at_which_step_by_which_pruner_and_its_value() -> None:
    pruned = trial(TrialState.PRUNED, {1: 0.3, 3: 0.42})
    assert ending_of(pruned, "PRUNED") == "PRUNED"
    assert why_ended(pruned, "hyperband", None) == "pruned at step 3 (value 0.42) by the hyperband pruner"


def test_a_trial_pruned_without_a_job_says_why() -> None:
    unfit = trial(TrialState.PRUNED, {})
    assert why_ended(unfit, "none", "its layout does not fit") == "pruned: its layout does not fit"


def test_an_exploited_trial_is_told_apart_from_a_pruned_one() -> None:
    exploited = trial(TrialState.PRUNED, {8: 0.5}, **{ATTR_CONTINUED_IN: 12})
    assert ending_of(exploited, "PRUNED") == "EXPLOITED"
    assert why_ended(exploited, "none", None).startswith(
        "exploited at step 8 by PBT: its member goes on in trial 12"
    )


def test_a_paused_trial_says_its_step_and_rung() -> None:
    paused = trial(TrialState.RUNNING, {2: 0.4}, **{ATTR_ASHA: AshaState(1, True, 1).to_attr()})
    assert why_ended(paused, "asha", None).startswith("paused at step 2 (rung 1) by ASHA")


def test_a_failed_trial_gives_the_first_line_of_its_runbook() -> None:
    failed = trial(TrialState.FAIL, {2: 0.4})
    why = why_ended(failed, "none", "Trial 3 (local job 9) FAILED\nLast lines: ...")
    assert why == "failed at step 2: Trial 3 (local job 9) FAILED"


@pytest.mark.parametrize(("ending", "name"), [("EXPLOITED", "Exploited"), (None, "Pruned")])
def test_the_line_names_the_ending_or_else_the_outcome(ending: object, name: str) -> None:
    record = TrialRecord.model_validate(
        {"number": 4, "outcome": "PRUNED", "params": {}, "job_dir": "/j", "checkpoint_dir": "/c",
         "ending": ending, "why": "w"}
    )  # fmt: skip
    assert ending_line(record, "search") == f"search/trial-4 {name}: w"
    assert name in ENDING_NAMES.values()


def test_the_summarys_row_says_exploited_where_optuna_says_pruned() -> None:
    from tunepod.pipeline import TrialRow

    exploited = TrialRecord.model_validate(
        {"number": 4, "outcome": "PRUNED", "params": {}, "job_dir": "/j", "checkpoint_dir": "/c",
         "ending": "EXPLOITED", "why": "w"}
    )  # fmt: skip
    assert TrialRow.of(exploited).outcome == "EXPLOITED"
    assert TrialRow.of(exploited.model_copy(update={"ending": None})).outcome == "PRUNED"
