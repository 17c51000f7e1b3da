"""Every step kind through ``PipelineRun`` with real jobs and stores, without Prefect (the flow has
its own tests): stage from a local folder, tune, train on the best params, evaluate, register."""

from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient

from tunepod.outputs import Dataset, Evaluation, Registration, StepOutput, TrialSet
from tunepod.pipeline import PipelineRun

SPEC = "tests/fixtures/specs/steps_pipeline.yaml"


def test_every_step_kind_in_order(in_repo: Path, isolated_overrides: list[str], tmp_path: Path) -> None:
    overrides = [*isolated_overrides, f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log"]
    run = PipelineRun.start(SPEC, overrides)
    outputs: dict[str, StepOutput] = {}
    for name in run.dag.order:
        outputs[name] = run.run_step(name, {need: outputs[need] for need in run.spec.steps[name].needs})
    run.finish(ok=True)

    data, search, final = outputs["data"], outputs["search"], outputs["final"]
    assert isinstance(data, Dataset) and data.copied_files == data.num_files > 0
    assert Path(data.path, "steps_pipeline.yaml").is_file()
    assert isinstance(search, TrialSet) and len(search.trials) == 3
    assert isinstance(final, TrialSet) and final.study is None
    best = search.best(1)[0]
    (trained,) = final.trials
    assert trained.params["x"] == best.params["x"]
    assert trained.params["epochs"] == 3  # the train step's own args win over the tuned ones
    assert trained.value is not None and trained.model_id is not None
    check = outputs["check"]
    assert isinstance(check, Evaluation)
    assert check.best.value == 1.0 - (float(best.params["x"]) - 0.3) ** 2  # type: ignore[arg-type]
    promote = outputs["promote"]
    assert isinstance(promote, Registration) and promote.alias_moved

    client = MlflowClient(run.tracker.tracking_uri)
    train_run = client.get_run(trained.run_id or "")
    assert train_run.data.tags["mlflow.parentRunId"] == run.run_id
    assert train_run.data.tags["tunepod.state"] == "COMPLETE"
    assert train_run.data.metrics["quality"] == check.best.value
    assert client.get_run(run.run_id).info.status == "FINISHED"
    summary = run.summary(outputs)
    assert summary.num_completed == 4  # three trials and the train run
    assert summary.registration == promote


def test_restaging_an_unchanged_folder_copies_nothing(
    in_repo: Path, isolated_overrides: list[str], tmp_path: Path
) -> None:
    first = PipelineRun.start(SPEC, isolated_overrides).run_step("data", {})
    again = PipelineRun.start(SPEC, isolated_overrides).run_step("data", {})
    assert isinstance(first, Dataset) and isinstance(again, Dataset)
    assert first.copied_files > 0
    assert again.copied_files == 0 and again.num_files == first.num_files
