"""The register step against a real MLflow SQLite store: a version every time, the alias only when the
new version beats the one holding it."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from tunepod.errors import JobError
from tunepod.outputs import Candidate, Evaluation, TrialRecord
from tunepod.pipeline import PipelineRun
from tunepod.spec.models import RegisterSettings
from tunepod.steps import register

SPEC = Path(__file__).resolve().parents[2] / "examples" / "digits" / "pipeline.yaml"


@pytest.fixture
def run(tmp_path: Path, in_repo: Path, isolated_overrides: list[str]) -> PipelineRun:
    return PipelineRun.start(SPEC, isolated_overrides)


def evaluation(run: PipelineRun, tmp_path: Path, value: float, direction: str = "maximize") -> Evaluation:
    checkpoint = tmp_path / f"ckpt-{value}" / "step-000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.pt").write_bytes(b"weights")
    trial_run = run.tracker.start_run("trial-0", parent_run_id=run.run_id)
    model_id = run.tracker.log_checkpoint_model(trial_run, checkpoint, name="trial-0", step=1, params={})
    trial = TrialRecord(
        number=0,
        outcome="COMPLETE",
        params={},
        value=value,
        run_id=trial_run,
        model_id=model_id,
        job_dir=str(checkpoint.parent),
        checkpoint_dir=str(checkpoint.parent),
    )
    candidate = Candidate(trial=trial, value=value, eval_job_dir=str(tmp_path))
    return Evaluation(step="check", metric="test_accuracy", direction=direction, candidates=[candidate])  # type: ignore[arg-type]


def champion(run: PipelineRun) -> str:
    client = MlflowClient(run.tracker.tracking_uri)
    return str(client.get_model_version_by_alias("digits-mlp", "champion").version)


def test_alias_moves_only_to_a_better_version(run: PipelineRun, tmp_path: Path) -> None:
    settings = RegisterSettings(model="digits-mlp")

    first = register.run(run, "promote", settings, {"check": evaluation(run, tmp_path, 0.90)})
    assert (first.version, first.alias_moved, first.previous_version) == ("1", True, None)
    assert champion(run) == "1"

    worse = register.run(run, "promote", settings, {"check": evaluation(run, tmp_path, 0.80)})
    assert (worse.version, worse.alias_moved, worse.previous_value) == ("2", False, 0.90)
    assert champion(run) == "1"

    better = register.run(run, "promote", settings, {"check": evaluation(run, tmp_path, 0.95)})
    assert (better.version, better.alias_moved, better.previous_version) == ("3", True, "1")
    assert champion(run) == "3"
    tags = MlflowClient(run.tracker.tracking_uri).get_model_version("digits-mlp", "3").tags
    assert tags["tunepod.metric"] == "test_accuracy"
    assert float(tags["tunepod.value"]) == 0.95


def test_minimize_and_unconditional_moves(run: PipelineRun, tmp_path: Path) -> None:
    conditional = RegisterSettings(model="digits-mlp")
    register.run(run, "promote", conditional, {"check": evaluation(run, tmp_path, 0.5, "minimize")})
    lower = register.run(run, "promote", conditional, {"check": evaluation(run, tmp_path, 0.4, "minimize")})
    assert lower.alias_moved

    always = RegisterSettings(model="digits-mlp", only_if_better=False)
    higher = register.run(run, "promote", always, {"check": evaluation(run, tmp_path, 0.9, "minimize")})
    assert higher.alias_moved
    assert champion(run) == higher.version


def test_a_trial_without_checkpoint_cannot_be_registered(run: PipelineRun, tmp_path: Path) -> None:
    found = evaluation(run, tmp_path, 0.9)
    found.candidates[0].trial.model_id = None
    with pytest.raises(JobError, match=r"left no checkpoint .* fix: call ctx.save_checkpoint"):
        register.run(run, "promote", RegisterSettings(model="digits-mlp"), {"check": found})


def test_registering_the_same_model_again_makes_no_new_version(run: PipelineRun, tmp_path: Path) -> None:
    """Finding 8: Prefect retries a step that already registered (or a rerun repeats it): the version
    made from that logged model is found again, and the alias stays where the first attempt put it."""
    settings = RegisterSettings(model="digits-mlp")
    scored = {"check": evaluation(run, tmp_path, 0.90)}
    first = register.run(run, "promote", settings, scored)
    retried = register.run(run, "promote", settings, scored)

    assert (first.version, retried.version) == ("1", "1")
    assert retried.alias_moved and champion(run) == "1"
    versions = MlflowClient(run.tracker.tracking_uri).search_model_versions("name = 'digits-mlp'")
    assert [str(v.version) for v in versions] == ["1"]
