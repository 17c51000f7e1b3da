"""Every step kind through ``PipelineRun`` with real jobs and stores, without Prefect (the flow has
its own tests): stage from a local folder, tune, train on the best params, evaluate, register."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from tunepod.errors import JobError
from tunepod.hpo.study import make_storage
from tunepod.outputs import Dataset, Evaluation, Registration, StepOutput, TrialSet
from tunepod.pipeline import PipelineRun

SPEC = "tests/fixtures/specs/steps_pipeline.yaml"


def test_every_step_kind_in_order(in_repo: Path, isolated_overrides: list[str], tmp_path: Path) -> None:
    overrides = [*isolated_overrides, f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log"]
    overrides.append("steps.search.with.num_parallel=3")  # the three trials in one wave
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
    parent = client.get_run(run.run_id)
    assert parent.info.status == "FINISHED"
    # The stage step's figures and target, written in one batch.
    assert parent.data.metrics["data.num_files"] == parent.data.metrics["data.copied_files"] == data.num_files
    assert parent.data.tags["tunepod.data.path"] == data.path
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


def test_a_two_objective_study_records_its_pareto_front(
    in_repo: Path, isolated_overrides: list[str], tmp_path: Path
) -> None:
    """score (maximize) against cost = 10 x (minimize): every trial is told both values, the front is
    on the pipeline run (table and tags) and on each trial's run, and the best trial handed to the
    steps after it (a train step's parameters, evaluate's top_k) is the front's best score."""
    overrides = [
        *isolated_overrides,
        f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log",
        "steps.search.with.study.objectives="
        "[{metric: score, direction: maximize}, {metric: cost, direction: minimize}]",
        "steps.search.with.num_trials=4",
        "steps.search.with.num_parallel=4",
        "steps.search.with.sampler=nsga2",
    ]
    run = PipelineRun.start(SPEC, overrides)
    data = run.run_step("data", {})
    search = run.run_step("search", {"data": data})
    run.finish(ok=True)

    assert isinstance(search, TrialSet)
    assert [g.metric for g in search.objectives] == ["score", "cost"]
    assert len(search.completed()) == 4
    for trial in search.trials:
        x = float(trial.params["x"])  # type: ignore[arg-type]
        assert trial.values == {"score": 1.0 - (x - 0.3) ** 2, "cost": 10 * x}
        assert trial.value == trial.values["score"]
    # Non-dominated: no other trial scores at least as well for at most the cost, better in one.
    expected = {
        t.number
        for t in search.trials
        if not any(
            o.values["score"] >= t.values["score"]
            and o.values["cost"] <= t.values["cost"]
            and o.values != t.values
            for o in search.trials
        )
    }
    front = {t.number for t in search.pareto_front()}
    assert front == expected and front
    best_on_front = max((t for t in search.trials if t.number in front), key=lambda t: t.values["score"])
    assert search.best(1)[0].number == best_on_front.number

    study = optuna.load_study(study_name="steps", storage=make_storage(f"journal://{tmp_path}/optuna.log"))
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    client = MlflowClient(run.tracker.tracking_uri)
    pipeline_run = client.get_run(run.run_id)
    assert pipeline_run.data.tags["tunepod.search.pareto_front"] == ",".join(map(str, sorted(front)))
    table_file = client.download_artifacts(run.run_id, "search/pareto_front.json", str(tmp_path))
    table = json.loads(Path(table_file).read_text())
    assert sorted(row[0] for row in table["data"]) == sorted(front)
    assert table["columns"] == ["trial", "score", "cost", "run_id"]
    for trial in search.trials:
        tags = client.get_run(trial.run_id or "").data.tags
        assert tags["tunepod.pareto_front"] == str(trial.number in front).lower()
        assert client.get_run(trial.run_id or "").data.metrics["cost"] == trial.values["cost"]
    summary = run.summary({"data": data, "search": search})
    assert summary.objectives == ["score", "cost"]
    assert {row.number for row in summary.trials if row.pareto_front} == front


def test_constraints_mark_infeasible_trials_and_keep_them_from_every_later_step(
    in_repo: Path, isolated_overrides: list[str], tmp_path: Path
) -> None:
    """``cost >= 5`` (cost = 10 x) rules out the best score (x near 0.3): infeasible trials are marked
    in Optuna (through its constraint API, which the samplers read), on their MLflow runs and in the
    summary, and the train, evaluate and register steps only ever see feasible ones."""
    overrides = [
        *isolated_overrides,
        f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log",
        "steps.search.with.num_trials=6",
        "steps.search.with.num_parallel=3",
        "steps.search.with.constraints=['cost >= 5']",
        "steps.search.with.sampler=tpe",  # a sampler that takes constraints (its first 10 are random)
    ]
    run = PipelineRun.start(SPEC, overrides)
    outputs: dict[str, StepOutput] = {}
    for name in run.dag.order:
        outputs[name] = run.run_step(name, {need: outputs[need] for need in run.spec.steps[name].needs})
    run.finish(ok=True)

    search = outputs["search"]
    assert isinstance(search, TrialSet) and len(search.completed()) == 6
    feasible = {t.number: float(t.params["x"]) >= 0.5 for t in search.trials}  # type: ignore[arg-type]
    assert set(feasible.values()) == {True, False}, "the seed should draw both kinds"
    assert {t.number: t.feasible for t in search.trials} == feasible
    study = optuna.load_study(study_name="steps", storage=make_storage(f"journal://{tmp_path}/optuna.log"))
    for trial in study.trials:
        assert trial.constraints == {"cost >= 5": 5 - 10 * trial.params["x"]}  # Optuna's constraint API

    best = search.best(1)[0]
    assert best.feasible and best.value == max(t.value or 0 for t in search.trials if t.feasible)
    final = outputs["final"]
    assert isinstance(final, TrialSet) and final.trials[0].params["x"] == best.params["x"]
    client = MlflowClient(run.tracker.tracking_uri)
    for trial in search.trials:
        assert (
            client.get_run(trial.run_id or "").data.tags["tunepod.feasible"]
            == str(feasible[trial.number]).lower()
        )
    summary = run.summary(outputs)
    assert {
        row.number: row.feasible for row in summary.trials if row.run_id in {t.run_id for t in search.trials}
    } == feasible


def test_an_unreported_constrained_metric_fails_the_trials_and_none_feasible_fails_the_step(
    in_repo: Path, isolated_overrides: list[str], tmp_path: Path
) -> None:
    base = [*isolated_overrides, f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log"]
    run = PipelineRun.start(
        SPEC, [*base, "steps.search.with.num_trials=2", "steps.search.with.constraints=['mem <= 1']"]
    )
    data = run.run_step("data", {})
    with pytest.raises(JobError, match="none of 2 trials completed") as raised:
        run.run_step("search", {"data": data})
    assert "finished without reporting 'mem'; fix: report it with ctx.report(step, mem=...)" in str(
        raised.value
    )

    overrides = [*base, "steps.search.with.study.name=never", "steps.search.with.constraints=['cost >= 100']"]
    run = PipelineRun.start(SPEC, [*overrides, "steps.search.with.num_trials=2"])
    with pytest.raises(JobError, match="2 trials completed and none met the study's constraints"):
        run.run_step("search", {"data": data})
