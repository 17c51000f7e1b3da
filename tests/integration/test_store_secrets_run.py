"""``tunepod run`` as a user runs it, on stores whose URIs hold a password: the password reaches neither
the console (tunepod's lines, Prefect's log of the failed flow) nor what the run records in MLflow.

A store that is down is a real one: a ``postgresql://`` or ``http://`` URL on a loopback port nothing
listens on. The run on working stores needs the PostgreSQL of ``scripts/postgres-up`` (skipped
without it, failed under CI).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from ports import free_port
from postgres import fresh_database
from tiny_study import write_tiny_study

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cret-Pa55"


def tunepod_run(spec: Path, tmp_path: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`tunepod run` in its own process, on the session's Prefect server, without the stack's runner."""
    from prefect.settings import PREFECT_API_URL

    environment = {
        **os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "TUNEPOD_RUNNER": "off",
        "COLUMNS": "200", **env,
    }  # fmt: skip
    argv = [sys.executable, "-m", "tunepod.cli", "run", str(spec), "--home", str(tmp_path / "no-stack")]
    argv += [f"--set={override}" for override in overrides]
    return subprocess.run(
        argv, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600, check=False
    )


def with_study_storage(spec: Path, storage: str) -> None:
    document = yaml.safe_load(spec.read_text())
    document["steps"]["search"]["with"]["study"]["storage"] = storage
    spec.write_text(yaml.safe_dump(document, sort_keys=False))


@pytest.mark.parametrize(
    ("down", "shown_as"),
    [
        ("tracking database", "cannot open the MLflow tracking store postgresql://tunepod:***@127.0.0.1:{port}/x"),
        ("tracking server", "cannot open the MLflow tracking store http://tunepod:***@127.0.0.1:{port}/x"),
        ("study storage", "cannot open the study storage postgresql://tunepod:***@127.0.0.1:{port}/x"),
    ],
    ids=["tracking database", "tracking server", "study storage"],
)  # fmt: skip
def test_a_run_on_a_store_that_is_down_fails_naming_it_without_its_password(
    prefect_api: None, tmp_path: Path, down: str, shown_as: str
) -> None:
    port = free_port()
    scheme = "http" if down == "tracking server" else "postgresql"
    url = f"{scheme}://tunepod:{SECRET}@127.0.0.1:{port}/x"
    tracking = url if down.startswith("tracking") else f"sqlite:///{tmp_path}/mlflow.db"
    spec, _, _ = write_tiny_study(tmp_path, tracking, num_trials=1, epochs=1)
    if down == "study storage":
        with_study_storage(spec, url)
    # One refused request, not MLflow's minutes of retries.
    done = tunepod_run(spec, tmp_path, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="5")
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-4000:]
    assert "pipeline failed: " in done.stderr
    assert shown_as.format(port=port) in output
    assert SECRET not in output


def test_a_run_on_postgresql_stores_shows_and_records_no_password(prefect_api: None, tmp_path: Path) -> None:
    with fresh_database("secrets_mlflow") as tracking, fresh_database("secrets_optuna") as storage:
        password = tracking.split("@", 1)[0].rsplit(":", 1)[1]
        spec, _, _ = write_tiny_study(tmp_path, tracking, num_trials=1, epochs=1)
        # An override that names a store: the run records its overrides in MLflow.
        done = tunepod_run(spec, tmp_path, f"steps.search.with.study.storage={storage}")
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-4000:]
        host = tracking.split("@", 1)[1]
        assert f"MLflow store: postgresql+psycopg://tunepod:***@{host} (pipeline run " in done.stdout
        assert f"mlflow ui --backend-store-uri postgresql+psycopg://tunepod:***@{host}" in done.stdout
        assert password not in output

        client = MlflowClient(tracking.replace("postgresql://", "postgresql+psycopg://", 1))
        [experiment] = [e for e in client.search_experiments() if e.name == "tiny"]
        [pipeline_run] = client.search_runs([experiment.experiment_id], "tags.`tunepod.pipeline` = 'tiny'")
        assert (
            "steps.search.with.study.storage=postgresql://tunepod:***@"
            in (pipeline_run.data.tags["tunepod.overrides"])
        )
        recorded = Path(client.download_artifacts(pipeline_run.info.run_id, "spec.yaml", str(tmp_path)))
        assert "storage: postgresql://tunepod:***@" in recorded.read_text()
        every_value = [*pipeline_run.data.tags.values(), *pipeline_run.data.params.values()]
        assert not any(password in value for value in every_value)
        assert password not in recorded.read_text()
