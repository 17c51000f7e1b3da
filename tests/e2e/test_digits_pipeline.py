"""The digits pipeline end to end: a real Prefect API, real torchrun DDP jobs, real Optuna and MLflow
stores. Small budget: 4 trials, 2 in parallel, 3 epochs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect_server import task_runs_of

from flows.pipeline import pipeline
from tunepod.pipeline import PipelineSummary

pytestmark = pytest.mark.slow


def small_budget(tmp_path: Path) -> list[str]:
    return [
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
        f"launcher.root={tmp_path}/shared",
        f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log",
        "steps.search.with.num_trials=4",
        "steps.search.with.num_parallel=2",
        "steps.search.with.train.args.epochs=3",
        "steps.check.with.top_k=2",
    ]


def test_digits_pipeline_end_to_end(prefect_api: None, in_repo: Path, tmp_path: Path) -> None:
    state = pipeline("examples/digits/pipeline.yaml", small_budget(tmp_path), return_state=True)
    assert_pipeline_recorded(state, tmp_path, num_trials=4)


@pytest.mark.slurm
def test_digits_pipeline_on_slurm(prefect_api: None, in_repo: Path, tmp_path: Path) -> None:
    state = pipeline("examples/digits/pipeline-slurm.yaml", small_budget(tmp_path), return_state=True)
    summary = assert_pipeline_recorded(state, tmp_path, num_trials=4)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for trial in summary.trials:
        tags = client.get_run(trial.run_id or "").data.tags
        assert tags["tunepod.launcher"] == "slurm"
        assert tags["tunepod.job_id"].isdigit()
        assert Path(tags["tunepod.job_dir"], "job.sbatch").is_file()


def assert_pipeline_recorded(state: Any, tmp_path: Path, num_trials: int) -> PipelineSummary:
    """The flow run COMPLETED, its trials are child runs of one parent, the winner holds the alias,
    and the Prefect API has every step and trial task run plus the artifacts."""
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
    assert len(children) == num_trials
    states = [r.data.tags["tunepod.state"] for r in children]
    assert "COMPLETE" in states
    assert set(states) <= {"COMPLETE", "PRUNED", "FAIL"}
    assert parent.info.status == "FINISHED"
    plots = {Path(a.path).name for a in client.list_artifacts(parent.info.run_id, "search/plots")}
    assert {"optimization_history.png", "param_importances.png", "intermediate_values.png"} <= plots, plots
    assert parent.data.tags["prefect.flow_run_id"] == str(state.state_details.flow_run_id)

    version = client.get_model_version_by_alias("digits-mlp", "champion")
    assert summary.registration is not None
    assert str(version.version) == summary.registration.version
    assert float(version.tags["tunepod.value"]) > 0.5
    assert summary.best is not None and summary.best.outcome == "COMPLETE"
    assert summary.evaluation

    with get_client(sync_client=True) as prefect:
        flow_run = prefect.read_flow_run(state.state_details.flow_run_id)
        task_runs = task_runs_of(prefect, flow_run.id)
        artifacts = prefect.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
        )
    assert flow_run.state is not None and flow_run.state.type.value == "COMPLETED"
    names = {t.name for t in task_runs}
    assert {"data", "search", "check", "promote"} <= names
    assert {f"search/trial-{n}" for n in range(num_trials)} <= names
    by_key = {a.key: a for a in artifacts}
    assert {"trials", "mlflow-run", "search-progress", "search-trials"} <= set(by_key)
    assert float(by_key["search-progress"].data) == 100.0  # type: ignore[arg-type]  # the live view's end
    assert parent.info.run_id in str(by_key["mlflow-run"].data)
    assert "trial" in str(by_key["trials"].data) and "COMPLETE" in str(by_key["trials"].data)
    return summary


def only(folder: Path) -> Path:
    """The one job dir of a train step (its name is a key of what the job is)."""
    (job_dir,) = folder.iterdir()
    return job_dir


def test_independent_steps_run_concurrently(prefect_api: None, in_repo: Path, tmp_path: Path) -> None:
    overrides = [f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"launcher.root={tmp_path}/shared"]
    summary = pipeline("tests/fixtures/specs/independent_steps.yaml", overrides)

    assert summary.num_completed == 2
    steps = tmp_path / "shared" / "jobs" / "independent"
    jobs = [only(steps / "left"), only(steps / "right")]
    started = [float((j / "starts.log").read_text().split()[0]) for j in jobs]
    finished = [(j / "result.json").stat().st_mtime for j in jobs]
    # Each job started before the other one finished: they ran side by side.
    assert started[0] < finished[1] and started[1] < finished[0]
