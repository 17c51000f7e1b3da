"""The digits pipeline end to end: a real Prefect API, real torchrun DDP jobs, real Optuna and MLflow
stores. Small budget: 4 trials, 2 in parallel, 3 epochs."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.pipeline import pipeline
from tunepod.pipeline import PipelineSummary

pytestmark = pytest.mark.slow


def test_digits_pipeline_end_to_end(prefect_api: None, in_repo: Path, tmp_path: Path) -> None:
    overrides = [
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"launcher.root={tmp_path}/shared",
        f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log",
        "steps.search.with.num_trials=4",
        "steps.search.with.num_parallel=2",
        "steps.search.with.train.args.epochs=3",
        "steps.check.with.top_k=2",
    ]
    state = pipeline("examples/digits/pipeline.yaml", overrides, return_state=True)

    assert state.is_completed(), state.message
    summary = state.result()
    assert isinstance(summary, PipelineSummary)

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("digits")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 4
    states = [r.data.tags["tunepod.state"] for r in children]
    assert "COMPLETE" in states
    assert set(states) <= {"COMPLETE", "PRUNED", "FAIL"}
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["prefect.flow_run_id"] == str(state.state_details.flow_run_id)

    version = client.get_model_version_by_alias("digits-mlp", "champion")
    assert summary.registration is not None
    assert str(version.version) == summary.registration.version
    assert float(version.tags["tunepod.value"]) > 0.5
    assert summary.best is not None and summary.best.outcome == "COMPLETE"
    assert summary.evaluation

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as prefect:
        flow_run = prefect.read_flow_run(state.state_details.flow_run_id)
        task_runs = prefect.read_task_runs()
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
        )
    assert flow_run.state is not None and flow_run.state.type.value == "COMPLETED"
    names = {t.name for t in task_runs if t.flow_run_id == flow_run.id}
    assert {"data", "search", "check", "promote"} <= names
    assert {f"trial-{n}" for n in range(4)} <= names
    by_key = {a.key: a for a in artifacts}
    assert {"trials", "mlflow-run"} <= set(by_key)
    assert parent.info.run_id in str(by_key["mlflow-run"].data)
    assert "trial" in str(by_key["trials"].data) and "COMPLETE" in str(by_key["trials"].data)


def test_independent_steps_run_concurrently(prefect_api: None, in_repo: Path, tmp_path: Path) -> None:
    overrides = [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"launcher.root={tmp_path}/shared"]
    summary = pipeline("tests/fixtures/specs/independent_steps.yaml", overrides)

    assert summary.num_completed == 2
    jobs = sorted((tmp_path / "shared" / "jobs" / "independent" / summary.run_id).iterdir())
    assert [j.name for j in jobs] == ["left", "right"]
    started = [float((j / "starts.log").read_text().split()[0]) for j in jobs]
    finished = [(j / "result.json").stat().st_mtime for j in jobs]
    # Each job started before the other one finished: they ran side by side.
    assert started[0] < finished[1] and started[1] < finished[0]
