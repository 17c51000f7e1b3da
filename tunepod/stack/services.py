"""The services of the local stack: how each one starts and how to tell it is healthy (pure, plus HTTP).

Prefect and MLflow are driven by their command lines (``python -m prefect ...``) and Prefect's HTTP API,
never imported: ``tunepod`` must not import Prefect, and the commands keep start-up fast.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
from collections.abc import Mapping

import httpx

from tunepod.stack import runner
from tunepod.stack.config import StackConfig
from tunepod.stack.processes import Service
from tunepod.stack.watch import CLIENT_MAX_RETRIES, run_environment_defaults
from tunepod.stores import (
    StoreUrlError,
    is_postgres,
    prefect_database_url,
    redacted,
    sync_sqlalchemy_url,
)

PREFECT_SERVER = "prefect-server"
PREFECT_WORKER = "prefect-worker"
MLFLOW_SERVER = "mlflow-server"
WEBHOOK = "webhook"
RUNNER = "runner"

_HTTP_TIMEOUT_S = 3.0


def prefect_env(config: StackConfig) -> dict[str, str]:
    """The environment of every Prefect process of the stack, and of ``prefect deploy``."""
    return {
        **os.environ,
        "PREFECT_HOME": str(config.prefect_home),
        "PREFECT_API_URL": config.prefect_api_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_COLORS": "false",
        # Flow runs the worker starts ride out a restarted server as `tunepod run` does.
        "PREFECT_CLIENT_MAX_RETRIES": os.environ.get("PREFECT_CLIENT_MAX_RETRIES", str(CLIENT_MAX_RETRIES)),
    }


def prefect_server(config: StackConfig) -> Service:
    argv = [config.python, "-m", "prefect", "server", "start"]
    argv += ["--host", config.host, "--port", str(config.prefect_port)]
    health = f"{config.prefect_api_url}/health"
    env = prefect_env(config)
    if config.prefect_database:
        # In the environment, not argv: the URL holds a password and argv is in the service record.
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = prefect_database_url(config.prefect_database)
    return Service(PREFECT_SERVER, argv, env, config.prefect_url, health)


def prefect_worker(config: StackConfig) -> Service:
    """A process worker on the stack's pool. Its name is unique per start, so a worker record left by an
    earlier start (Prefect shows it ONLINE for a while) is never taken for this one."""
    name = f"{config.work_pool}-{secrets.token_hex(3)}"
    argv = [config.python, "-m", "prefect", "worker", "start", "--pool", config.work_pool]
    argv += ["--type", "process", "--name", name]
    url = f"{config.prefect_url}/work-pools/work-pool/{config.work_pool}"
    return Service(PREFECT_WORKER, argv, prefect_env(config), url, "")


def worker_name(argv: list[str]) -> str:
    """The ``--name`` a worker was started with (from its recorded argv)."""
    return argv[argv.index("--name") + 1]


def tunepod_runner(config: StackConfig) -> Service:
    """The process that forks each `tunepod run` on this stack (``tunepod.stack.runner``). Its environment
    is what a `tunepod run` from the same shell has, not the other services': the runs it forks must
    see the settings they would have had in a process of their own."""
    argv = [config.python, "-m", "flows.runner", "--home", str(config.home)]
    env = {**run_environment_defaults(), **os.environ, "PREFECT_API_URL": config.prefect_api_url}
    return Service(RUNNER, argv, env, f"tunepod run --home {config.home}", "")


def mlflow_server(config: StackConfig) -> Service:
    """MLflow's tracking server, serving artifacts itself (clients upload through it, so they need no
    S3 credentials of their own). Its stores go through the environment, not argv: a database URL holds
    a password and argv is in the service record."""
    argv = [config.python, "-m", "mlflow", "server"]
    argv += ["--host", config.host, "--port", str(config.mlflow_port)]
    argv += ["--workers", str(config.mlflow_workers)]
    database = config.mlflow_database or f"sqlite:///{config.home / 'mlflow.db'}"
    env = {
        **os.environ,
        "MLFLOW_BACKEND_STORE_URI": sync_sqlalchemy_url(database),
        "MLFLOW_ARTIFACTS_DESTINATION": config.mlflow_artifacts or str(config.home / "mlartifacts"),
        # Without this the server starts ~7 job-execution workers (1.7 GB) that tunepod never uses.
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    return Service(MLFLOW_SERVER, argv, env, config.mlflow_url, f"{config.mlflow_url}/health")


def store_setting_errors(config: StackConfig) -> list[str]:
    """What is wrong with the stack's database and artifact settings (empty when nothing is), each
    naming the ``tunepod up`` option and the fix; checked before anything starts."""
    errors = []
    if config.prefect_database:
        try:
            prefect_database_url(config.prefect_database)
        except StoreUrlError as exc:
            errors.append(f"--prefect-database {exc}")
    database = config.mlflow_database
    if database and not (is_postgres(database) or database.startswith("sqlite:///")):
        errors.append(
            f"--mlflow-database {redacted(database)!r}: tunepod runs MLflow's server on PostgreSQL or "
            "SQLite; fix: give postgresql://user:password@host:5432/db (or sqlite:////absolute/path.db)"
        )
    artifacts = config.mlflow_artifacts
    if artifacts and artifacts.startswith("s3://") and importlib.util.find_spec("boto3") is None:
        errors.append(
            f"--mlflow-artifacts {artifacts}: the MLflow server needs boto3 for S3; "
            "fix: pip install 'tunepod[aws]'"
        )
    return errors


def store_notes(config: StackConfig) -> dict[str, str]:
    """Where the servers keep their data, for ``up``'s table (passwords hidden)."""
    prefect = config.prefect_database or f"sqlite under {config.prefect_home}"
    mlflow = config.mlflow_database or f"sqlite:///{config.home / 'mlflow.db'}"
    artifacts = config.mlflow_artifacts or str(config.home / "mlartifacts")
    return {
        PREFECT_SERVER: f"database: {redacted(prefect)}",
        MLFLOW_SERVER: f"store: {redacted(mlflow)}; artifacts: {artifacts}",
    }


def webhook_receiver(config: StackConfig, secrets: Mapping[str, str]) -> Service:
    """The receiver, with ``secrets`` (variable -> secret, generated for hooks whose variable the user
    did not export) added to its environment."""
    argv = [config.python, "-m", "tunepod.webhook", "serve", "--config", str(config.webhook_config)]
    argv += ["--host", config.host, "--port", str(config.webhook_port)]
    argv += ["--state-dir", str(config.home / "webhook")]
    health = f"{config.webhook_url}/healthz"
    return Service(WEBHOOK, argv, {**prefect_env(config), **secrets}, config.webhook_url, health)


def webhook_unavailable(config: StackConfig) -> str | None:
    """Why the webhook receiver cannot start here (None when it can): the module or its config is missing."""
    if importlib.util.find_spec("tunepod.webhook") is None:
        return "module tunepod.webhook is not installed"
    if not config.webhook_config.is_file():
        return f"no receiver config at {config.webhook_config}"
    return None


def check_health(config: StackConfig, name: str, argv: list[str], health_url: str) -> bool:
    """Whether the service ``name``, started with ``argv``, is healthy; never raises (an error means
    unhealthy)."""
    if health_url:
        return http_ok(health_url)
    if name == RUNNER:
        return runner.ping(config.home) is not None
    return worker_online(config, worker_name(argv))


def http_ok(url: str) -> bool:
    """Whether ``GET url`` answers 2xx."""
    try:
        return httpx.get(url, timeout=_HTTP_TIMEOUT_S).is_success
    except httpx.HTTPError:
        return False


def worker_online(config: StackConfig, name: str) -> bool:
    """Whether the worker ``name`` has sent a heartbeat to the pool recently (Prefect says ONLINE)."""
    url = f"{config.prefect_api_url}/work_pools/{config.work_pool}/workers/filter"
    try:
        response = httpx.post(url, json={}, timeout=_HTTP_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    if not response.is_success:
        return False
    return any(w.get("name") == name and w.get("status") == "ONLINE" for w in response.json())
