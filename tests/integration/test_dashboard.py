"""``tunepod dashboard`` as a user runs it: a real optuna-dashboard process on the spec's study
storage, read over HTTP; and the choice of study when it is not clear."""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path

import httpx
import optuna
import yaml
from ports import free_port
from typer.testing import CliRunner

from tunepod.cli import app
from tunepod.hpo.study import make_storage

REPO = Path(__file__).resolve().parents[2]
SPEC = "examples/digits/pipeline.yaml"
TUNEPOD = [sys.executable, "-m", "tunepod.cli"]


def test_the_dashboard_serves_the_specs_study_over_http(tmp_path: Path) -> None:
    storage = f"journal://{tmp_path}/optuna.log"
    study = optuna.create_study(study_name="digits", storage=make_storage(storage), direction="maximize")
    for value in (0.5, 0.7, 0.6):
        trial = study.ask({"lr": optuna.distributions.FloatDistribution(1e-3, 0.3, log=True)})
        study.tell(trial, value)
    port = free_port()
    argv = [*TUNEPOD, "dashboard", SPEC, "--set", f"steps.search.with.study.storage={storage}"]
    server = subprocess.Popen(
        [*argv, "--port", str(port)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        studies = wait_for_json(f"http://127.0.0.1:{port}/api/studies", server)["study_summaries"]
        [shown] = studies
        assert shown["study_name"] == "digits" and shown["directions"] == ["maximize"]
        detail = httpx.get(f"http://127.0.0.1:{port}/api/studies/{shown['study_id']}", timeout=10).json()
        assert [t["values"] for t in detail["trials"]] == [[0.5], [0.7], [0.6]]
        assert detail["best_trials"][0]["values"] == [0.7]
    finally:
        server.terminate()
        output = server.communicate(timeout=30)[0]
    assert f"optuna-dashboard on {storage}: http://127.0.0.1:{port}/dashboard/" in output


def test_a_step_that_is_not_a_tune_step_is_refused_with_the_choices() -> None:
    done = subprocess.run(
        [*TUNEPOD, "dashboard", SPEC, "--step", "check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert "--step check: not a tune step of this spec; its tune steps: search" in done.stderr


def wait_for_json(url: str, server: subprocess.Popen[str], limit_s: float = 60.0) -> dict[str, object]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert server.poll() is None, server.communicate()[0]
        try:
            response = httpx.get(url, timeout=5)
            if response.is_success:
                return dict(response.json())
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} did not answer within {limit_s} s")


def test_two_tune_steps_on_different_storages_need_a_step(in_repo: Path, tmp_path: Path) -> None:
    spec = yaml.safe_load(Path("tests/fixtures/specs/steps_pipeline.yaml").read_text())
    second = copy.deepcopy(spec["steps"]["search"])
    second["with"]["study"]["storage"] = f"journal://{tmp_path}/other.log"
    spec["steps"]["search2"] = second
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = CliRunner().invoke(app, ["dashboard", str(path)])
    assert done.exit_code == 2
    assert "the spec has 2 tune steps; fix: choose one with --step (search, search2)" in done.stderr
