"""The Prefect layer against a real Prefect API: trials are task runs named after the step and trial, and
only transient errors are retried."""

from __future__ import annotations

import gc
import json
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.task_engine import SyncTaskRunEngine
from prefect.transactions import get_transaction
from prefect.utilities.callables import parameter_schema
from prefect_server import task_runs_of

from tasks.steps import run_trial, submit_trial
from tunepod.errors import JobError, TransientError
from tunepod.outputs import TrialRecord


class ScriptedTuner:
    """Stands in for ``Tuner.run_trial`` only, to raise chosen errors before succeeding; the retry
    policy under test is Prefect's, run for real."""

    step = "search"
    settings = SimpleNamespace(num_trials=1)

    def __init__(self, *errors: BaseException, record: TrialRecord | None = None) -> None:
        self.errors = list(errors)
        self.calls = 0
        self.record = record

    def trial_set(self) -> SimpleNamespace:
        return SimpleNamespace(trials=[], objectives=[])

    def run_trial(self, number: int, links: object = None) -> TrialRecord:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.record or TrialRecord(
            number=number, outcome="COMPLETE", params={}, value=1.0, job_dir="/j", checkpoint_dir="/c"
        )


@flow
def one_trial(tuner: Any, number: int) -> TrialRecord:
    return submit_trial(tuner, number).result()


@pytest.fixture(autouse=True)
def no_retry_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_trial, "retry_delay_seconds", 0)


@pytest.mark.parametrize(
    "error",
    [
        TransientError("scheduler did not answer"),
        sqlite3.OperationalError("database is locked"),
        TimeoutError(),
    ],
)
def test_transient_errors_are_retried(prefect_api: None, error: BaseException) -> None:
    tuner = ScriptedTuner(error)
    record = one_trial(tuner, 3)
    assert record.number == 3
    assert tuner.calls == 2


def test_other_errors_fail_at_once(prefect_api: None) -> None:
    tuner = ScriptedTuner(JobError("trial 3 FAILED"))
    state = one_trial(tuner, 3, return_state=True)
    assert state.is_failed()
    assert tuner.calls == 1
    with pytest.raises(JobError, match="trial 3 FAILED"):
        state.result()


def test_each_trial_is_a_task_run_named_after_its_step_and_number(prefect_api: None) -> None:
    state = one_trial(ScriptedTuner(), 7, return_state=True)
    with get_client(sync_client=True) as client:
        runs = task_runs_of(client, state.state_details.flow_run_id)
    assert [t.name for t in runs] == ["search/trial-7"]
    assert runs[0].state is not None and runs[0].state.is_completed()


def _engines_left(bound: int, settle_s: float = 10.0) -> int:
    """Task engines still alive, once those below ``bound`` or after ``settle_s``: a trial's result
    reaches its future before its engine's thread has finished tearing down, so the last few engines
    may outlive their results briefly; a step that kept them would keep all of them for good."""
    deadline = time.monotonic() + settle_s
    while True:
        gc.collect()
        engines = sum(type(o) is SyncTaskRunEngine for o in gc.get_objects())  # isinstance wakes lazy modules
        if engines < bound or time.monotonic() > deadline:
            return engines
        time.sleep(0.2)


@task(cache_policy=NO_CACHE)
def step_of_trials(tuner: Any, count: int) -> tuple[list[TrialRecord], int, int]:
    """A tune step's task run: submits ``count`` trials from inside it, as ``Tuner.run`` does."""
    records = [future.result() for future in [submit_trial(tuner, number) for number in range(count)]]
    engines = _engines_left(bound=count // 4)
    step_transaction = get_transaction()
    assert step_transaction is not None, "a task run runs inside its transaction"
    return records, len(step_transaction.children), engines


@flow
def one_step(tuner: Any, count: int) -> tuple[list[TrialRecord], int, int]:
    return step_of_trials(tuner, count)


def test_a_finished_trials_task_run_is_not_kept_by_its_step(prefect_api: None) -> None:
    """A trial's task run, submitted from its step's, is no child of the step's transaction, which
    would hold it (its engine, task run, events and result) until the step ends: the memory of a
    study would grow with its trials."""
    count = 40
    records, children, engines = one_step(ScriptedTuner(), count)
    assert [r.number for r in records] == list(range(count))
    assert children == 0
    assert engines < count // 4, f"{engines} task engines alive after {count} trials ended"


@pytest.mark.parametrize(
    ("outcome", "ending", "why", "name"),
    [
        ("PRUNED", "PRUNED", "pruned at step 3 (value 0.42) by the hyperband pruner", "Pruned"),
        (
            "PAUSED",
            "PAUSED",
            "paused at step 4 (rung 1) by ASHA: not among the best of its rung yet",
            "Paused",
        ),
        ("PRUNED", "EXPLOITED", "exploited at step 8 by PBT: its member goes on in trial 12", "Exploited"),
        ("FAIL", "FAIL", "failed at step 2: Trial 7 (local job 1) FAILED", "Failed"),
        ("COMPLETE", "COMPLETE", "completed at step 9 with 0.97", "Completed"),
    ],
)
def test_a_trials_task_run_is_named_for_how_it_ended_and_says_why(
    prefect_api: None, outcome: Any, ending: Any, why: str, name: str
) -> None:
    """A pruned, paused or exploited trial never shows as a bare Completed: the task run's state is
    named for its ending, with why and at which step as its message; its result is still the record."""
    record = TrialRecord(
        number=7, outcome=outcome, params={}, job_dir="/j", checkpoint_dir="/c", ending=ending, why=why
    )
    state = one_trial(ScriptedTuner(record=record), 7, return_state=True)
    assert state.result() == record
    with get_client(sync_client=True) as client:
        [run] = task_runs_of(client, state.state_details.flow_run_id)
    assert run.state is not None
    assert (run.state.name, run.state.message) == (name, why)
    assert run.state.is_completed(), "a trial's ending is no failure of the task: the study goes on"


def test_the_run_form_has_typed_fields_and_a_bad_value_stops_the_run_before_it_starts(
    prefect_api: None, in_repo: Path, tmp_path: Path
) -> None:
    """The deployment's form in the Prefect UI is the flow's parameter schema: typed, described, with
    the launcher as a choice. Prefect checks a value against it before the flow body runs: nothing is
    tracked (the flow's first act would be to open the MLflow run)."""
    from flows.pipeline import pipeline

    schema = parameter_schema(pipeline.fn).model_dump()["properties"]
    assert schema["num_trials"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    assert schema["launcher"]["anyOf"][0]["enum"] == ["local", "slurm", "hyperpod_eks", "sagemaker"]
    assert all(schema[name].get("description") for name in schema), schema
    store = tmp_path / "mlflow.db"
    state = pipeline(
        "examples/digits/pipeline.yaml", [f"tracking.uri=sqlite:///{store}"], num_trials=0, return_state=True
    )
    assert state.is_failed()
    assert "num_trials" in str(state.message) and "greater than or equal to 1" in str(state.message)
    assert not store.exists()


def test_a_tune_step_shows_live_progress_and_links_each_trial_to_mlflow_and_back(
    prefect_api: None, in_repo: Path, isolated_overrides: list[str], tmp_path: Path
) -> None:
    """The flow on a quick spec (stage, then three trials): the tune step's task run carries a
    progress artifact that reached 100 and a trial table written as trials finished (the latest
    version holds every trial); each trial's task run links its MLflow run, and that run carries the
    task run's id."""
    from mlflow import MlflowClient
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    from flows.pipeline import pipeline

    storage = f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log"
    spec = tmp_path / "stage-and-tune.yaml"  # the steps after the tune add nothing here but time
    written = yaml.safe_load(Path("tests/fixtures/specs/steps_pipeline.yaml").read_text())
    written["steps"] = {name: written["steps"][name] for name in ("data", "search")}
    spec.write_text(yaml.safe_dump(written))
    state = pipeline(str(spec), [*isolated_overrides, storage], return_state=True)
    assert state.is_completed(), state.message
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        ours = ArtifactFilterFlowRunId(any_=[flow_run_id])  # the session server holds other runs' too
        by_key = {
            key: client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]), flow_run_id=ours)
            )
            for key in ("search-progress", "search-trials")
        }
        [progress] = by_key["search-progress"]
        task_runs = {t.name: t for t in task_runs_of(client, flow_run_id)}
        markdown = [
            a
            for a in client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ours))
            if a.type == "markdown"
        ]
    assert float(progress.data) == 100.0  # type: ignore[arg-type]
    assert progress.task_run_id == task_runs["search"].id
    latest = max(by_key["search-trials"], key=lambda a: str(a.created))
    rows = json.loads(str(latest.data))  # a table artifact's data is its JSON text
    assert sorted(row["trial"] for row in rows) == [0, 1, 2]

    mlflow = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    trial_runs = mlflow.search_runs(
        [mlflow.get_experiment_by_name("steps").experiment_id], "tags.`tunepod.step` = 'search'"
    )
    assert len(trial_runs) == 3
    for trial_run in trial_runs:
        task = task_runs[f"search/trial-{trial_run.data.tags['tunepod.trial']}"]
        assert trial_run.data.tags["prefect.task_run_id"] == str(task.id)
        [link] = [a for a in markdown if a.task_run_id == task.id]
        assert trial_run.info.run_id in str(link.data)
