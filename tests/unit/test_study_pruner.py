"""Every trial's driver thread asks the study's pruner at once; the pruner tunepod builds survives that.

Found by the digits pipeline in CI: two trials reaching their first prunable epoch together made
Optuna's Hyperband pruner build its brackets twice and fail with "This line should be unreachable".
Here the threads are released together by a barrier and the interpreter switches threads as often as
it can, which made the plain ``HyperbandPruner`` fail in nearly every round.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import optuna
import pytest

from tunepod.hpo.study import make_pruner
from tunepod.spec.models import PrunerSpec

THREADS = 8
ROUNDS = 40


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def study_with_running_trials(pruner: optuna.pruners.BasePruner) -> optuna.Study:
    """One completed trial (so Hyperband can size its brackets) and THREADS running ones at epoch 3."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(pruner=pruner)
    done = study.ask()
    for epoch in range(27):
        done.report(0.5, epoch)
    study.tell(done, 0.5)
    for _ in range(THREADS):
        study.ask().report(0.1, 3)
    return study


def prune_all_at_once(study: optuna.Study) -> list[bool | BaseException]:
    running = [trial for trial in study.trials if trial.state == optuna.trial.TrialState.RUNNING]
    barrier = threading.Barrier(len(running))
    outcomes: list[bool | BaseException] = [False] * len(running)

    def ask(index: int, trial: optuna.trial.FrozenTrial) -> None:
        barrier.wait()
        try:
            outcomes[index] = study.pruner.prune(study, trial)
        except Exception as error:  # the outcome under test is "raised or not"
            outcomes[index] = error

    threads = [threading.Thread(target=ask, args=pair) for pair in enumerate(running)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


@pytest.mark.usefixtures("frequent_thread_switches")
def test_hyperband_asked_from_many_threads_at_once_answers_each_like_one_thread() -> None:
    spec = PrunerSpec(kind="hyperband", min_resource=2)
    serial = study_with_running_trials(make_pruner(spec))
    expected = [
        serial.pruner.prune(serial, trial)
        for trial in serial.trials
        if trial.state == optuna.trial.TrialState.RUNNING
    ]
    for _ in range(ROUNDS):
        assert prune_all_at_once(study_with_running_trials(make_pruner(spec))) == expected


def test_the_samplers_still_see_hyperband_brackets() -> None:
    study = study_with_running_trials(make_pruner(PrunerSpec(kind="hyperband", min_resource=2)))
    bracket_study = optuna.pruners._filter_study(study, study.trials[-1])
    assert bracket_study is not study
