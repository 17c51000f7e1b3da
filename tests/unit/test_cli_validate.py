"""``tunepod validate`` and ``tunepod graph``: exit codes, where the output goes, and a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tunepod.cli import app
from tunepod.dag import build_dag
from tunepod.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
VALID = "tests/fixtures/specs/valid.yaml"

runner = CliRunner()


@pytest.fixture(autouse=True)
def _from_repo_root(in_repo: Path) -> None:
    """Spec paths (and the entrypoints inside the fixtures) are relative to the repository root."""


def test_valid_spec_prints_ok_with_the_step_order() -> None:
    result = runner.invoke(app, ["validate", VALID])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        f"OK {VALID}: pipeline digits-hpo, 4 steps in order: data, search, check, promote"
    )
    assert result.stderr == ""


def test_invalid_spec_prints_every_issue_to_stderr_and_exits_2(tmp_path: Path) -> None:
    text = (REPO / VALID).read_text()
    broken = tmp_path / "broken.yaml"
    broken.write_text(text.replace("uses: evaluate", "uses: evaluat").replace("uses: tune", "uses: tuen"))
    result = runner.invoke(app, ["validate", str(broken)])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert f"invalid pipeline spec {broken} (2 errors):" in result.stderr
    assert f"{broken}:11: steps.search.uses: unknown step kind 'tuen'" in result.stderr
    assert f"{broken}:28: steps.check.uses: unknown step kind 'evaluat'" in result.stderr
    assert "    fix: use one of: stage, tune, train, evaluate, register, export (did you mean 'tune'?)" in (
        result.stderr
    )


def test_missing_spec_file_exits_2() -> None:
    result = runner.invoke(app, ["validate", "no/such/pipeline.yaml"])
    assert result.exit_code == 2
    assert f"no/such/pipeline.yaml: <root>: file not found (looked for {REPO}/no/such/pipeline.yaml)" in (
        result.stderr
    )


@pytest.mark.parametrize(
    ("overrides", "exit_code", "expected"),
    [
        (["steps.search.with.num_trials=40", "name=renamed"], 0, "pipeline renamed, 4 steps"),
        (
            ["steps.search.with.num_trials=ten"],
            2,
            "--set steps.search.with.num_trials=ten: steps.search.with.num_trials: expected an integer",
        ),
        (["no-equals-sign"], 2, "--set no-equals-sign: no-equals-sign: malformed override"),
    ],
    ids=["valid", "bad value", "malformed"],
)
def test_set_overrides(overrides: list[str], exit_code: int, expected: str) -> None:
    args = ["validate", VALID]
    for override in overrides:
        args += ["--set", override]
    result = runner.invoke(app, args)
    assert result.exit_code == exit_code, result.output
    assert expected in (result.stdout if exit_code == 0 else result.stderr)


ALLOWED = "fix: use only letters, digits, '_', '-' and '.', and not '.' or '..' alone"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("name=..", "name"),
        ("steps.search.with.study.name=..", "steps.search.with.study.name"),
        ("steps.search.with.study.name=.", "steps.search.with.study.name"),
    ],
    ids=["pipeline", "study", "study '.'"],
)
def test_validate_refuses_a_name_that_would_put_job_dirs_outside_jobs(override: str, field: str) -> None:
    # The names become folders: <root>/jobs/<study>/trial-N, <root>/jobs/<pipeline>/<step>/<key>.
    result = runner.invoke(app, ["validate", VALID, "--set", override])
    assert result.exit_code == 2, result.output
    value = override.partition("=")[2]
    assert f"--set {override}: {field}: {value!r} cannot name a folder of job dirs" in result.stderr
    assert f"    {ALLOWED}" in result.stderr


def test_validate_refuses_a_step_named_dot_dot(tmp_path: Path) -> None:
    spec = tmp_path / "pipeline.yaml"
    text = (REPO / VALID).read_text()
    spec.write_text(text.replace("  check:\n", "  '..':\n").replace("[check]", "['..']"))
    result = runner.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 2, result.output
    assert f"{spec}:27: steps...: step name '..' cannot name a folder of job dirs" in result.stderr
    assert "    fix: rename the step: any name but '.' or '..', without '/' or '\\'" in result.stderr


def test_graph_prints_mermaid() -> None:
    result = runner.invoke(app, ["graph", VALID])
    assert result.exit_code == 0, result.output
    assert result.stdout == build_dag(load_spec(VALID)).to_mermaid()
    assert result.stdout.startswith("flowchart LR\n")


def test_graph_of_invalid_spec_exits_2() -> None:
    result = runner.invoke(app, ["graph", VALID, "--set", "steps.check.needs=[data]"])
    assert result.exit_code == 2
    assert "--set steps.check.needs=[data]: steps.check.needs[0]: 'data' is a stage step" in result.stderr


def test_help_lists_the_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "validate" in result.stdout and "graph" in result.stdout


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def test_real_process_exit_codes() -> None:
    ok = _python("-m", "tunepod.cli", "validate", VALID)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"OK {VALID}: pipeline digits-hpo")
    bad = _python("-m", "tunepod.cli", "validate", VALID, "--set", "steps.search.needs=[]")
    assert bad.returncode == 2
    expected = "--set steps.search.needs=[]: steps.search.needs: a tune step takes exactly one stage step"
    assert expected in bad.stderr


def test_cli_does_not_import_heavy_libraries() -> None:
    # tunepod.dag first: it imports the spec package, which imports the loader, which uses tunepod.dag.
    probe = "import sys, tunepod.dag, tunepod.cli; print(sorted({m.split('.')[0] for m in sys.modules}))"
    loaded = _python("-c", probe)
    assert loaded.returncode == 0, loaded.stderr
    for heavy in ("mlflow", "optuna", "torch", "prefect", "sklearn"):
        assert f"'{heavy}'" not in loaded.stdout


def test_the_fsx_example_is_valid_as_written() -> None:
    # Its placeholders (file system id, bucket) are well-formed: only AWS itself could reject them.
    result = runner.invoke(app, ["validate", "examples/digits/pipeline-fsx.yaml"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (
        "OK examples/digits/pipeline-fsx.yaml: pipeline digits-hpo-fsx, 5 steps in order: "
        "data, search, check, promote, save"
    )
    spec = load_spec("examples/digits/pipeline-fsx.yaml")
    assert build_dag(spec).inputs("save") == {"tune": "search"}


SAGEMAKER_DIGITS = "examples/digits/pipeline-sagemaker.yaml"


def test_validate_accepts_the_sagemaker_digits_spec() -> None:
    result = runner.invoke(app, ["validate", SAGEMAKER_DIGITS])
    assert result.exit_code == 0, result.output
    expected = "pipeline digits-hpo-sagemaker, 4 steps in order: data, search, check, promote"
    assert result.stdout.strip() == f"OK {SAGEMAKER_DIGITS}: {expected}"
    spec = load_spec(SAGEMAKER_DIGITS)
    assert spec.launcher.kind == "sagemaker"
    local = load_spec("examples/digits/pipeline.yaml")
    # The same steps as the local spec, each of the same kind with the same inputs.
    assert {name: (step.uses, step.needs) for name, step in spec.steps.items()} == {
        name: (step.uses, step.needs) for name, step in local.steps.items()
    }


def test_validate_rejects_the_sagemaker_digits_spec_without_its_vpc() -> None:
    result = runner.invoke(app, ["validate", SAGEMAKER_DIGITS, "--set", "launcher.subnets=[]"])
    assert result.exit_code == 2
    assert "fsx needs the jobs in its VPC" in result.stderr
