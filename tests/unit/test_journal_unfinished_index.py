"""The journal storage's read of the unfinished trials (Optuna's ask for the WAITING ones, the tuner's
for the RUNNING and WAITING ones): kept by an index instead of a pass over every trial, it answers
what Optuna's own journal storage answers, whoever appended to the journal."""

from __future__ import annotations

import random
from pathlib import Path

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import FrozenTrial, TrialState

from tunepod.hpo.study import UnfinishedIndexedJournalStorage, make_storage

UNFINISHED = (TrialState.RUNNING, TrialState.WAITING)
READS = [UNFINISHED, (TrialState.WAITING,), (TrialState.RUNNING,), (TrialState.COMPLETE,), None]


def numbers(trials: list[FrozenTrial]) -> list[tuple[int, str]]:
    return [(t.number, t.state.name) for t in trials]


def plain(journal: Path) -> optuna.Study:
    """The same study read by Optuna's own journal storage: the answer to match."""
    return optuna.load_study(study_name="s", storage=JournalStorage(JournalFileBackend(str(journal))))


def test_make_storage_opens_a_journal_with_the_index(tmp_path: Path) -> None:
    assert isinstance(make_storage(f"journal://{tmp_path}/optuna.log"), UnfinishedIndexedJournalStorage)


def test_every_read_matches_optunas_own_as_two_orchestrators_ask_enqueue_and_tell(tmp_path: Path) -> None:
    journal = tmp_path / "optuna.log"
    mine = optuna.create_study(study_name="s", storage=make_storage(f"journal://{journal}"))
    theirs = optuna.load_study(study_name="s", storage=make_storage(f"journal://{journal}"))
    draw = random.Random(0)
    for move in range(120):
        study = draw.choice([mine, theirs])
        open_numbers = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
        roll = draw.random()
        if roll < 0.4 or not open_numbers:
            study.ask()  # pops a WAITING trial when there is one
        elif roll < 0.5:
            study.enqueue_trial({"x": draw.random()}, skip_if_exists=False)
        else:
            ending = draw.choice([TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL])
            value = draw.random() if ending is TrialState.COMPLETE else None
            study.tell(draw.choice(open_numbers), value, state=ending)
        reference = plain(journal)
        for states in READS:
            for reader in (mine, theirs):
                got = reader.get_trials(deepcopy=False, states=states)
                assert numbers(got) == numbers(reference.get_trials(deepcopy=False, states=states)), (
                    f"move {move}, states {states}"
                )


def test_a_finished_trial_leaves_the_index_and_a_trial_that_starts_stays_in_it(tmp_path: Path) -> None:
    storage = make_storage(f"journal://{tmp_path}/optuna.log")
    assert isinstance(storage, UnfinishedIndexedJournalStorage)
    study = optuna.create_study(study_name="s", storage=storage)
    for _ in range(50):
        study.tell(study.ask(), 1.0)
    study.enqueue_trial({"x": 0.5})
    waiting = study.get_trials(deepcopy=False, states=UNFINISHED)
    running = study.ask()  # the enqueued trial, now RUNNING
    assert numbers(waiting) == [(50, "WAITING")]
    assert numbers(study.get_trials(deepcopy=False, states=UNFINISHED)) == [(running.number, "RUNNING")]
    # Only the unfinished trial is kept: a read costs the trials in flight, not the 50 finished ones.
    assert storage._open[study._study_id].ids == {running._trial_id}


def test_a_read_with_deepcopy_hands_out_copies(tmp_path: Path) -> None:
    study = optuna.create_study(study_name="s", storage=make_storage(f"journal://{tmp_path}/optuna.log"))
    study.ask()
    copied = study._storage.get_all_trials(study._study_id, deepcopy=True, states=UNFINISHED)
    copied[0].user_attrs["mutated"] = True
    assert "mutated" not in study._storage.get_all_trials(study._study_id, states=UNFINISHED)[0].user_attrs


def test_a_study_that_does_not_exist_is_refused_as_optuna_refuses_it(tmp_path: Path) -> None:
    storage = make_storage(f"journal://{tmp_path}/optuna.log")
    with pytest.raises(KeyError):
        storage.get_all_trials(7, states=UNFINISHED)
