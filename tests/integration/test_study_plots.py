"""A tune step writes its study's plots to the pipeline's MLflow run: real quadratic jobs on the local
launcher, a journal Optuna storage and an MLflow SQLite store, through ``PipelineRun`` (no Prefect).

Proves: the pipeline run holds ``<step>/plots/`` with the optimization history, the importances and
the learning curves, as PNG; an ASHA study's curves mark the pause that was promoted and the pauses
that never were; a plot the study cannot have (importances of one trial) is left out and the step
goes on; an artifact store that refuses the plots does not fail the step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from mlflow import MlflowClient
from PIL import Image

from tunepod.outputs import TrialSet
from tunepod.pipeline import PipelineRun

SPEC = "tests/fixtures/specs/steps_pipeline.yaml"
PLOTS = ["intermediate_values.png", "optimization_history.png", "param_importances.png"]
# ASHA with one rung, at 2 units (step 1), halving: trials run one at a time in this order. 0.3 (the
# best) leads the rung alone and goes on; 0.4 is paused behind it, as is 0.9; when 1.0 reaches the
# rung, four are there and the top two go on: 0.4 is promoted, 1.0 paused. 0.9 and 1.0 are never
# promoted, and end PRUNED once nothing else runs.
XS = (0.3, 0.4, 0.9, 1.0)
ASHA = "{kind: asha, min_resource: 2, reduction_factor: 2, max_resource: 4}"


def tune_step(
    tmp_path: Path, overrides: list[str], before: Callable[[PipelineRun], None] = lambda run: None
) -> tuple[PipelineRun, TrialSet]:
    """The steps pipeline's data and search steps, ``overrides`` on its search step's ``with``;
    ``before`` is called between them."""
    run = PipelineRun.start(
        SPEC,
        [
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"launcher.root={tmp_path}/shared",
            f"steps.search.with.study.storage=journal://{tmp_path}/optuna.log",
            *(f"steps.search.with.{override}" for override in overrides),
        ],
    )
    try:
        data = run.run_step("data", {})
        before(run)
        search = run.run_step("search", {"data": data})
    finally:
        run.finish(ok=True)
    assert isinstance(search, TrialSet)
    return run, search


def plots_of(run: PipelineRun) -> list[str]:
    client = MlflowClient(run.tracker.tracking_uri)
    return sorted(Path(f.path).name for f in client.list_artifacts(run.run_id, "search/plots"))


def png_text(run: PipelineRun, name: str, tmp_path: Path) -> dict[str, str]:
    client = MlflowClient(run.tracker.tracking_uri)
    local = client.download_artifacts(run.run_id, f"search/plots/{name}", str(tmp_path))
    image = Image.open(local)
    assert image.format == "PNG"
    return dict(image.text)  # type: ignore[attr-defined]


def test_an_asha_tune_step_writes_its_plots_with_the_pauses_and_the_promotion_marked(
    in_repo: Path, tmp_path: Path
) -> None:
    run, search = tune_step(
        tmp_path,
        [
            f"num_trials={len(XS)}",
            "num_parallel=1",
            f"pruner={ASHA}",
            f"space.x={{type: categorical, choices: {sorted(XS)}}}",
            f"enqueue={[{'x': x} for x in XS]}",
            "train.args={epochs: 4, sleep_s: 0.2}",
            # A long grace: every pause lands at the trainer's should_stop() (it saves there).
            "train.resources.stop_grace_s=60",
        ],
    )
    by_x = {float(t.params["x"]): t for t in search.trials}  # type: ignore[arg-type]
    assert {x: t.outcome for x, t in by_x.items()} == {
        0.3: "COMPLETE",
        0.4: "COMPLETE",
        0.9: "PRUNED",
        1.0: "PRUNED",
    }

    assert plots_of(run) == PLOTS
    curves = png_text(run, "intermediate_values.png", tmp_path)
    assert curves["Title"] == "Learning curves of study steps: score (maximize)"
    marked = curves["Description"].splitlines()
    # Each pause at the rung's step, 1: the promoted one, then the two never promoted.
    promoted, never = by_x[0.4].number, sorted(by_x[x].number for x in (0.9, 1.0))
    assert [line for line in marked if line.endswith("then promoted")] == [
        f"trial {promoted}, step 1 (value {score(0.4, 1):.6g}): paused by ASHA, then promoted"
    ]
    assert [line for line in marked if line.endswith("never promoted")] == [
        f"trial {n}, step 1 (value {score(x, 1):.6g}): paused by ASHA, never promoted"
        for n, x in zip(never, (0.9, 1.0), strict=True)
    ]
    assert "score (maximize)" in png_text(run, "param_importances.png", tmp_path)["Title"]
    # Every trial in one table beside the plots (Prefect's tables show 100 at most).
    client = MlflowClient(run.tracker.tracking_uri)
    table = json.loads(
        Path(client.download_artifacts(run.run_id, "search/trials.json", str(tmp_path))).read_text()
    )
    rows = dict(zip(table["columns"], zip(*table["data"], strict=True), strict=True))
    assert list(rows["trial"]) == [t.number for t in search.trials]
    assert list(rows["outcome"]) == [t.outcome for t in search.trials]


def score(x: float, step: int, epochs: int = 4) -> float:
    """The quadratic trainer's report at ``step``."""
    return (1.0 - (x - 0.3) ** 2) * (step + 1) / epochs


def test_a_plot_the_study_cannot_have_is_left_out_and_the_step_goes_on(
    in_repo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tunepod.steps.tune")
    run, search = tune_step(tmp_path, ["num_trials=1", "num_parallel=1"])

    assert [t.outcome for t in search.trials] == ["COMPLETE"]
    assert plots_of(run) == ["intermediate_values.png", "optimization_history.png"]
    said = [r.getMessage() for r in caplog.records if r.name == "tunepod.steps.tune"]
    assert said == ["step search: no param_importances plot: 1 completed trial(s); importances need 2"]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "tunepod.steps.tune")


def test_an_artifact_store_that_refuses_the_plots_does_not_fail_the_step(
    in_repo: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The step's artifact folder is taken by a file: MLflow cannot write under it. One warning (the
    other plots are not tried), and the step returns its trials."""
    caplog.set_level(logging.INFO, logger="tunepod.steps.tune")

    def block(run: PipelineRun) -> None:
        artifacts = run.tracker.client.get_run(run.run_id).info.artifact_uri
        Path(artifacts.removeprefix("file://"), "search").write_text("not a folder")

    run, search = tune_step(tmp_path, ["num_trials=2", "num_parallel=2"], before=block)

    assert plots_of(run) == []
    assert [t.outcome for t in search.trials] == ["COMPLETE", "COMPLETE"]
    warnings = [r for r in caplog.records if r.name == "tunepod.steps.tune" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].getMessage().startswith("step search: its plots were not written to MLflow: ")
