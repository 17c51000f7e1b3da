"""The local stack (`tunepod up/status/deploy/down`): real processes, free ports, state in a temp folder.

The slow tests share the session's stack (tests/local_stack.py: Prefect and MLflow on PostgreSQL,
MLflow's artifacts in S3) and run in file order, after the UI tests that share it too: up, up again,
status, deploy, runs that use the stack's server, down. Each command runs as its own process
(`python -m tunepod.stack ...`), as a user would run it. A signed webhook delivery that runs a
deployment through the worker, with the shipped trigger template, is tests/e2e/test_ui.py's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import optuna
import pytest
from local_stack import ARTIFACT_BUCKET, Stack
from ports import free_port
from tiny_study import write_tiny_study

from tunepod.hpo.study import make_storage
from tunepod.launch.local import read_process_stat
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_submission
from tunepod.stack.config import StackConfig
from tunepod.stack.manage import StackError, up
from tunepod.stack.processes import (
    Service,
    ServiceRecord,
    group_members,
    is_alive,
    start_service,
    stop_service,
)
from tunepod.stack.runner import ping

REPO = Path(__file__).resolve().parents[2]
FLOW_RUN_LIMIT_S = 300.0


# ------------------------------------------------------------------------------------ process records


def test_stop_service_ends_the_whole_group_and_a_reused_pid_is_not_ours(tmp_path: Path) -> None:
    # The shell's background child is in its group: it must go too.
    service = Service("sleeper", ["/bin/sh", "-c", "sleep 300 & sleep 300"], dict(os.environ), "", "")
    record = start_service(service, tmp_path / "sleeper.log", tmp_path, tmp_path / "sleeper.json")
    assert ServiceRecord.read(tmp_path / "sleeper.json") == record
    assert is_alive(record)
    wait_for(lambda: len(group_members(record.pid)) >= 2, "the shell and its sleeps")

    impostor = ServiceRecord(**{**record.__dict__, "start_ticks": record.start_ticks + 1})
    assert not is_alive(impostor)

    assert stop_service(record, grace_s=5.0) is True
    assert not is_alive(record)
    assert group_members(record.pid) == []
    assert stop_service(record, grace_s=5.0) is False


@contextlib.contextmanager
def squatter(folder: Path, health_path: str) -> Iterator[int]:
    """A plain HTTP server on a free port whose ``health_path`` answers 200; yields the port."""
    (folder / health_path).parent.mkdir(parents=True, exist_ok=True)
    (folder / health_path).write_text("true")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/{health_path}"), "the squatting server")
        yield port
    finally:
        server.terminate()
        server.wait()


def test_up_refuses_a_port_that_answers_for_a_process_it_did_not_start(tmp_path: Path) -> None:
    with squatter(tmp_path / "www", "api/health") as port:  # where the Prefect server would listen
        config = StackConfig(home=tmp_path / "home", repo=REPO, prefect_port=port, mlflow_port=free_port())
        with pytest.raises(StackError, match="already answers, but tunepod did not start"):
            up(config)
        assert not list((tmp_path / "home" / "stack").glob("*.json"))


def test_a_failed_up_stops_what_it_started(tmp_path: Path) -> None:
    """The Prefect server starts, then MLflow's port turns out taken: the error says so, and the
    Prefect server this ``up`` started is stopped, its record gone (a rerun starts clean)."""
    prefect_port = free_port()
    with squatter(tmp_path / "www", "health") as mlflow_port:
        config = StackConfig(
            home=tmp_path / "home", repo=REPO, prefect_port=prefect_port, mlflow_port=mlflow_port
        )
        with pytest.raises(StackError, match="already answers") as raised:
            up(config)
    assert "Stopped what this `up` had started: prefect-server" in str(raised.value)
    assert not list((tmp_path / "home" / "stack").glob("*.json"))
    assert not processes_with_argument(f"{prefect_port}"), "the Prefect server still runs"


def processes_with_argument(argument: str) -> list[int]:
    """Live processes with ``argument`` as one of their command-line arguments."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and argument.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


# ------------------------------------------------------------------------------------ the whole stack


@pytest.fixture
def stack(local_stack: Stack) -> Stack:
    """The session's stack (tests/local_stack.py): Prefect and MLflow on PostgreSQL, artifacts in S3."""
    return local_stack


@pytest.mark.slow
def test_up_brings_every_service_to_healthy_and_records_it(stack: Stack) -> None:
    records = stack.records()
    assert {"prefect-server", "prefect-worker", "mlflow-server", "runner"} <= set(records)
    for record in records.values():
        assert is_alive(record), record
        assert Path(record.log).is_file()
    assert http_ok(f"{stack.api}/health")
    assert http_ok(f"{records['mlflow-server'].url}/health")
    assert records["mlflow-server"].argv[-2:] == ["--workers", stack.env["TUNEPOD_MLFLOW_WORKERS"]]
    assert records["prefect-server"].url in stack.first_up
    assert "started" in stack.first_up
    assert http_ok(f"{records['webhook'].url}/healthz")
    assert ping(stack.home) == records["runner"].pid


@pytest.mark.slow
def test_up_puts_prefect_and_mlflow_on_postgresql_and_says_so_without_the_password(stack: Stack) -> None:
    """The servers' tables are in their PostgreSQL databases (nothing fell back to SQLite under the
    home), and `up` names each store with the password hidden, never in a service record."""
    assert table_count(stack.databases["prefect"], "flow_run") == 1
    assert table_count(stack.databases["mlflow"], "experiments") == 1
    assert not (stack.home / "mlflow.db").exists()
    assert not list((stack.home / "prefect").glob("*.db"))
    password = urlsplit(stack.databases["prefect"]).password
    assert password and password not in stack.first_up
    for path in (stack.home / "stack").glob("*.json"):
        assert password not in path.read_text(), path
    prefect_db = urlsplit(stack.databases["prefect"])
    assert f"database: postgresql://tunepod:***@{prefect_db.netloc.split('@')[1]}{prefect_db.path}" in (
        stack.first_up
    )
    assert f"artifacts: s3://{ARTIFACT_BUCKET}/mlflow" in stack.first_up


@pytest.mark.slow
def test_a_second_up_changes_nothing(stack: Stack) -> None:
    before = {name: (p.read_bytes()) for name, p in record_files(stack)}
    second = stack.cli("up")
    assert second.returncode == 0, second.stderr
    assert {name: p.read_bytes() for name, p in record_files(stack)} == before
    assert "started" not in second.stdout
    assert second.stdout.count("running") == len(before)


@pytest.mark.slow
def test_status_reports_each_service_with_its_pid_and_health(stack: Stack) -> None:
    result = stack.cli("status")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for name, record in stack.records().items():
        line = next(line for line in lines if name in line)
        assert str(record.pid) in line and "yes" in line and record.url in line


@pytest.mark.slow
def test_deploy_registers_both_deployments_with_inactive_schedule_and_trigger(stack: Stack) -> None:
    result = stack.cli("deploy")
    assert result.returncode == 0, result.stdout + result.stderr
    for name, spec, event in [
        ("digits", "examples/digits/pipeline.yaml", "tunepod.webhook.digits"),
        ("digits-slurm", "examples/digits/pipeline-slurm.yaml", "tunepod.webhook.digits-slurm"),
    ]:
        deployment = api_get(stack, f"/deployments/name/tunepod-pipeline/{name}")
        assert deployment["entrypoint"] == "flows/pipeline.py:pipeline"
        assert deployment["work_pool_name"] == "tunepod-local"
        assert deployment["parameters"] == {"spec_path": spec, "overrides": []}
        form = deployment["parameter_openapi_schema"]["properties"]  # the run form's typed fields
        assert form["num_trials"]["anyOf"][0] == {"type": "integer", "minimum": 1}
        assert set(form) == {"spec_path", "overrides", "num_trials", "num_parallel", "experiment", "launcher"}
        assert deployment["job_variables"]["working_dir"] == str(REPO)
        assert deployment["pull_steps"] == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
        ]
        [schedule] = deployment["schedules"]
        assert schedule["active"] is False and schedule["schedule"]["cron"] == "0 3 * * *"
        [automation] = automations_of(stack, deployment["id"])
        assert event in automation["trigger"]["expect"]
        parameters = automation["actions"][0]["parameters"]
        assert "event.payload.spec_path" in parameters["spec_path"]
        assert parameters["overrides"]["__prefect_kind"] == "json"


@pytest.mark.slow
def test_tunepod_run_uses_the_running_stack_when_no_prefect_api_is_set(stack: Stack, tmp_path: Path) -> None:
    env = {name: value for name, value in stack.env.items() if name != "PREFECT_API_URL"}
    mlflow = stack.records()["mlflow-server"].url  # already set up: no SQLite migrations in the run
    spec, _, _ = write_tiny_study(tmp_path, mlflow, 1, epochs=1)
    argv = [str(Path(sys.executable).parent / "tunepod"), "run", str(spec)]
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"using the Prefect server of the local stack: {stack.api}" in result.stderr
    # Forked by the stack's runner, which has Prefect, MLflow and Optuna imported already.
    assert "running in the local stack's runner (process " in result.stderr, result.stderr

    query = {"flow_runs": {"name": {"any_": [str(spec)]}}}
    runs = httpx.post(f"{stack.api}/flow_runs/filter", json=query, timeout=10.0).json()
    assert [(run["state_type"], run["deployment_id"]) for run in runs] == [("COMPLETED", None)]

    # The pipeline run's spec went through the MLflow server into its S3 bucket.
    from mlflow import MlflowClient

    client = MlflowClient(mlflow)
    experiment = client.get_experiment_by_name("tiny")
    assert experiment is not None
    [parent] = client.search_runs([experiment.experiment_id], "tags.`mlflow.runName` = 'tiny'")
    key = f"mlflow/{experiment.experiment_id}/{parent.info.run_id}/artifacts/spec.yaml"
    assert key in stack.artifact_keys()


@pytest.mark.slow
def test_the_runner_reports_a_bad_spec_as_tunepod_run_does(stack: Stack, tmp_path: Path) -> None:
    """`tunepod run` hands a plain command line to the runner unchecked; the child checks the spec and
    its error reaches the caller's stderr with the usual exit status."""
    env = {name: value for name, value in stack.env.items() if name != "PREFECT_API_URL"}
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nsteps: {}\nsurprise: 1\n")
    argv = [str(Path(sys.executable).parent / "tunepod"), "run", str(spec)]
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "running in the local stack's runner (process " in result.stderr
    assert f"invalid pipeline spec {spec}" in result.stderr and "surprise" in result.stderr, result.stderr


@pytest.mark.slow
def test_a_run_rides_out_its_prefect_server_killed_and_started_again(stack: Stack, tmp_path: Path) -> None:
    """Fault: SIGKILL of the Prefect server's process group while `tunepod run` (on the stack's server)
    tunes a study, then `tunepod up`, which starts only the server again, on the same database.

    Proves: the run says the server is gone (URL, what to do) and back, and exits 0 without a
    traceback; both trials COMPLETE, each trained once (one start, first submission); the restarted
    server holds the flow run and each trial's task run COMPLETED (events sent during the outage arrive).
    """
    mlflow = stack.records()["mlflow-server"].url  # already set up: no SQLite migrations in the run
    spec, jobs, journal = write_tiny_study(tmp_path, mlflow, num_trials=2)
    env = {name: value for name, value in stack.env.items() if name != "PREFECT_API_URL"}
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        run = subprocess.Popen(
            [sys.executable, "-m", "tunepod.cli", "run", str(spec)],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        # Killed as soon as a trial's job is launched: the trials train while the server restarts.
        wait_for(lambda: run.poll() is not None or any(jobs.glob("*/submission.json")), "a trial job", 180)
        assert run.poll() is None, log.read_text()[-6000:]
        server = stack.records()["prefect-server"]
        os.killpg(server.pid, signal.SIGKILL)
        wait_for(lambda: "does not answer" in log.read_text() or run.poll() is not None, "the warning", 60)
        again = stack.cli("up")
        assert again.returncode == 0, again.stdout + again.stderr
        code = run.wait(timeout=FLOW_RUN_LIMIT_S)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    output = log.read_text()
    assert code == 0, output[-6000:]
    assert f"Prefect server {stack.api} does not answer" in output and "tunepod up" in output, output
    assert f"Prefect server {stack.api} answers again" in output, output
    assert "Traceback" not in output, output
    restarted = stack.records()["prefect-server"]
    assert restarted.pid != server.pid and is_alive(restarted), again.stdout

    trials = optuna.load_study(study_name="tiny", storage=make_storage(f"journal://{journal}")).get_trials()
    assert [(t.number, t.state.name) for t in trials] == [(0, "COMPLETE"), (1, "COMPLETE")]
    for number in (0, 1):
        job_dir = jobs / f"trial-{number}"
        assert len((job_dir / "starts.log").read_text().splitlines()) == 1, f"trial {number} trained twice"
        submission = read_submission(JobPaths(job_dir))
        assert submission is not None and submission.attempt == 1, submission

    [flow_run] = api_post(stack, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [str(spec)]}}})
    assert flow_run["state_type"] == "COMPLETED", flow_run["state"]
    query = {"flow_runs": {"id": {"any_": [flow_run["id"]]}}}
    states = {t["name"]: t["state_type"] for t in api_post(stack, "/task_runs/filter", query)}
    assert sorted(states) == ["data", "search", "search/trial-0", "search/trial-1"], states
    assert set(states.values()) == {"COMPLETED"}, states


@pytest.mark.slow
def test_down_stops_everything_and_leaves_no_process(stack: Stack) -> None:
    records = stack.records()
    assert records
    result = stack.cli("down")
    assert result.returncode == 0, result.stderr
    for record in records.values():
        assert not is_alive(record), record
        assert group_members(record.pid) == []
        stat = read_process_stat(record.pid)
        assert stat is None or stat.is_dead or stat.start_ticks != record.start_ticks
    assert stack.records() == {}
    assert not http_ok(f"{stack.api}/health")
    again = stack.cli("down")
    assert again.returncode == 0 and "nothing recorded" in again.stdout


# ------------------------------------------------------------------------------------ helpers


def table_count(database: str, table: str) -> int:
    """How many tables named ``table`` the PostgreSQL database ``database`` holds."""
    import psycopg

    with psycopg.connect(database) as connection:
        row = connection.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_name = %s", (table,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def record_files(stack: Stack) -> list[tuple[str, Path]]:
    return [(p.stem, p) for p in sorted((stack.home / "stack").glob("*.json"))]


def api_post(stack: Stack, path: str, body: dict[str, Any]) -> Any:
    response = httpx.post(f"{stack.api}{path}", json=body, timeout=10.0)
    assert response.is_success, f"POST {path}: {response.status_code} {response.text}"
    return response.json()


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=3.0).is_success
    except httpx.HTTPError:
        return False


def api_get(stack: Stack, path: str) -> Any:
    response = httpx.get(f"{stack.api}{path}", timeout=10.0)
    assert response.is_success, f"GET {path}: {response.status_code} {response.text}"
    return response.json()


def automations_of(stack: Stack, deployment_id: str) -> list[dict[str, Any]]:
    url = f"{stack.api}/automations/related-to/prefect.deployment.{deployment_id}"
    response = httpx.get(url, timeout=10.0)
    assert response.is_success, response.text
    automations: list[dict[str, Any]] = response.json()
    return automations


def wait_for(condition: Any, what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)
