"""The study's tally: the counts the tuning loop and its gauges read at every ask and tell, kept
without walking every trial, equal to what a walk over every trial counts."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from tunepod.hpo.trials import StudyTrials


def walked(study: optuna.Study) -> Counter[str]:
    """What the walk the tally replaced counted: every trial, by state."""
    return Counter(t.state.name for t in study.get_trials(deepcopy=False))


def tallied(trials: StudyTrials) -> Counter[str]:
    tally = trials.tally()
    return Counter(
        {state: tally.count(state) for state in ("RUNNING", "WAITING", "COMPLETE", "PRUNED", "FAIL")}
    )


def test_the_tally_counts_what_the_walk_counted_as_trials_come_and_finish() -> None:
    study = optuna.create_study()
    trials = StudyTrials(study)
    endings = [TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, None]
    for round_ in range(5):
        asked = [study.ask().number for _ in range(4)]
        study.enqueue_trial({"x": 0.5})
        for number, ending in zip(asked, endings, strict=True):
            if ending is TrialState.COMPLETE:
                study.tell(number, float(number))
            elif ending is not None:
                study.tell(number, state=ending)
        assert +tallied(trials) == +walked(study), f"round {round_}"
    assert trials.tally().num_trials == len(study.trials)


def test_the_tally_sees_trials_another_orchestrator_added_and_ended(tmp_path: Path) -> None:
    storage = JournalStorage(JournalFileBackend(str(tmp_path / "journal.log")))
    mine = optuna.create_study(study_name="s", storage=storage)
    theirs = optuna.load_study(
        study_name="s", storage=JournalStorage(JournalFileBackend(str(tmp_path / "journal.log")))
    )
    trials = StudyTrials(mine)
    running = mine.ask().number
    trials.tally()
    for _ in range(3):
        theirs.tell(theirs.ask(), 1.0)
    theirs.tell(running, state=TrialState.PRUNED)
    assert +tallied(trials) == Counter({"COMPLETE": 3, "PRUNED": 1})


def test_a_finished_trial_is_read_once_however_many_tallies_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    study = optuna.create_study()
    for _ in range(10):
        study.tell(study.ask(), 1.0)
    trials = StudyTrials(study)
    trials.tally()
    reads: list[int] = []
    get_trial = study._storage.get_trial
    for _ in range(20):
        study.tell(study.ask(), 2.0)
        monkeypatch.setattr(study._storage, "get_trial", lambda i: reads.append(i) or get_trial(i))
        trials.tally()
        monkeypatch.setattr(study._storage, "get_trial", get_trial)
    assert len(reads) == 20, "each new trial read once, when first seen finished; no earlier one again"


def test_the_last_completion_is_the_newest_completed_trials() -> None:
    study = optuna.create_study()
    study.tell(study.ask(), 1.0)
    study.tell(study.ask(), state=TrialState.FAIL)
    trials = StudyTrials(study)
    completed = study.trials[0].datetime_complete
    assert completed is not None
    assert trials.tally().last_completed == completed.timestamp()
