"""LCBench through `tunepod run` agrees with the same study in simulated time, which is how the
LCBench table measures tunepod's arms (benchmarks/lcbench/agreement.py says what agreeing means).

For real: `tunepod run` as a process on the session's Prefect server, the local launcher, each trial
a process of examples/lcbench/train.py that sleeps a tenth of each epoch's surrogate time, a real
Optuna journal and MLflow store, the surrogate staged as the data. Simulated: the same tune step by
the real Tuner on the quality run's simulated world. One trial at a time, under the recommended
ASHA: trials paused at the first rung, one promoted and resumed from its checkpoint, the rest
pruned at the end, each parameter asked and each decision the same in both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.lcbench.agreement import Study, agree
from tunepod.hpo.asha import AshaState
from tunepod.hpo.study import make_storage

pytestmark = pytest.mark.slow


def test_a_study_through_tunepod_run_asks_and_decides_as_its_simulation(
    prefect_api: None, tmp_path: Path
) -> None:
    from prefect.settings import PREFECT_API_URL

    study = Study("3945", arm="tunepod-asha-forecast", trials=6, epochs=12, seed=0, time_scale=0.1)
    result = agree(study, tmp_path, env={"PREFECT_API_URL": str(PREFECT_API_URL.value())})

    assert not result.differences, "\n".join(result.differences)
    assert len(result.real) == study.trials
    assert {t.outcome for t in result.real} == {"COMPLETE", "PRUNED"}, [t.outcome for t in result.real]
    storage = make_storage(f"journal://{tmp_path}/optuna.log")
    trials = storage.get_all_trials(storage.get_study_id_from_name("lcbench-3945"))
    promoted = [t.number for t in trials if (state := AshaState.of(t)) is not None and state.promotions]
    assert promoted, "no trial was paused and promoted: the study proves no resume"
    for number in promoted:  # trained on past its pause, to its end
        assert sorted(result.real[number].values) == list(range(study.epochs)), number
