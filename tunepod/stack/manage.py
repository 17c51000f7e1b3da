"""``up``, ``down``, ``status`` and ``deploy`` of the local stack: Prefect server and worker, MLflow server,
webhook receiver, and the runner that forks each ``tunepod run`` (``tunepod.stack.runner``).

Every function is idempotent and keeps no state in memory: what runs is what the records under
``<home>/stack/`` say (checked against ``/proc``), so each command may run in a new process. Not safe to
run two of them at once on one home folder.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tunepod.errors import TunepodError
from tunepod.launch.paths import tail_lines
from tunepod.stack import services
from tunepod.stack.config import StackConfig
from tunepod.stack.processes import Service, ServiceRecord, is_alive, start_service, stop_service
from tunepod.stack.secrets import GeneratedSecrets, generate_missing
from tunepod.stores import redacted

_POLL_S = 0.5
_LOG_TAIL = 20
#: Each service's record by name.
Records = dict[str, ServiceRecord]
_ORDER = (
    services.PREFECT_SERVER,
    services.PREFECT_WORKER,
    services.MLFLOW_SERVER,
    services.WEBHOOK,
    services.RUNNER,
)


class StackError(TunepodError):
    """A service of the stack would not start, or the stack is not there for a command that needs it."""


@dataclass(frozen=True)
class ServiceStatus:
    """One line of ``up``/``down``/``status`` output."""

    name: str
    state: str
    """started (by this command), running (already), stopped (by this command), not running, skipped."""
    pid: int | None
    url: str
    healthy: bool
    detail: str = ""


def up(config: StackConfig) -> list[ServiceStatus]:
    """Start what does not run yet, wait until every service is healthy, and say what runs where.

    Raises ``StackError`` before starting anything when a database or artifact setting is unusable;
    (with the service's log tail) when a service exits or stays unhealthy for
    ``config.startup_timeout_s``, or when a port already answers for a process tunepod did not start.
    A failed (or interrupted) ``up`` stops what it started itself and leaves alone what already ran,
    so that it can simply be run again.
    """
    errors = services.store_setting_errors(config)
    if errors:
        raise StackError("\n".join(errors))
    for folder in (config.records_dir, config.logs_dir, config.prefect_home):
        folder.mkdir(parents=True, exist_ok=True)
    started: dict[str, bool] = {}
    records: dict[str, ServiceRecord] = {}
    try:
        skipped, generated = _start_all(config, records, started)
    except BaseException as exc:
        stopped = _stop_started(config, records, started)
        if isinstance(exc, StackError) and stopped:
            raise StackError(f"{exc}\nStopped what this `up` had started: {', '.join(stopped)}.") from None
        raise
    notes = {**services.store_notes(config), services.WEBHOOK: generated.note()}
    report = [
        ServiceStatus(
            r.name, "started" if started[r.name] else "running", r.pid, r.url, True, notes.get(r.name, "")
        )
        for r in _in_order(records)
    ]
    if skipped is not None:
        report.append(ServiceStatus(services.WEBHOOK, "skipped", None, config.webhook_url, False, skipped))
    return report


def _start_all(
    config: StackConfig, records: Records, started: dict[str, bool]
) -> tuple[str | None, GeneratedSecrets]:
    """Start every service in order and wait until each is healthy, filling ``records`` and ``started``
    as it goes (so that a failure part-way knows what to stop). Returns why the webhook was skipped,
    and the hook secrets generated for it."""
    wanted = [
        services.prefect_server(config),
        services.mlflow_server(config),
        services.tunepod_runner(config),
    ]
    skipped = services.webhook_unavailable(config)
    generated = GeneratedSecrets({}, {})
    if skipped is None:
        generated = generate_missing(config.webhook_config, config.secrets_dir)
        wanted.append(services.webhook_receiver(config, generated.env))
    for service in wanted:
        records[service.name], started[service.name] = _ensure_running(config, service)
    _wait_healthy(config, records[services.PREFECT_SERVER])
    ensure_work_pool(config)
    worker = services.prefect_worker(config)
    records[worker.name], started[worker.name] = _ensure_running(config, worker)
    for record in records.values():
        _wait_healthy(config, record)
    return skipped, generated


def _stop_started(config: StackConfig, records: Records, started: dict[str, bool]) -> list[str]:
    """Stop the services this ``up`` started (worker first) and remove their records; returns their names."""
    stopped = []
    for record in reversed(_in_order(records)):
        if started.get(record.name):
            stop_service(record, grace_s=5.0)
            _record_path(config, record.name).unlink(missing_ok=True)
            stopped.append(record.name)
    return stopped


def down(config: StackConfig, grace_s: float = 10.0) -> list[ServiceStatus]:
    """Stop every recorded service (worker first, Prefect's server last) and remove its record."""
    report = []
    for name in reversed(_ORDER):
        path = _record_path(config, name)
        record = ServiceRecord.read(path)
        if record is None:
            continue
        stopped = stop_service(record, grace_s)
        path.unlink(missing_ok=True)
        state = "stopped" if stopped else "not running"
        report.append(ServiceStatus(name, state, record.pid, record.url, False))
    return report


def status(config: StackConfig) -> list[ServiceStatus]:
    """What the records say runs, checked against ``/proc`` and each service's health check."""
    report = []
    for name in _ORDER:
        record = ServiceRecord.read(_record_path(config, name))
        if record is None:
            continue
        if not is_alive(record):
            report.append(ServiceStatus(name, "not running", record.pid, record.url, False, record.log))
            continue
        healthy = services.check_health(config, record.name, record.argv, record.health_url)
        report.append(ServiceStatus(name, "running", record.pid, record.url, healthy, record.log))
    return report


def running_prefect_api(home: Path) -> str | None:
    """The API URL of the Prefect server a ``tunepod up`` with state folder ``home`` started, if it runs
    and answers its health check; None otherwise (no stack, stopped, or a pid reused by another process)."""
    record = ServiceRecord.read(home.expanduser().resolve() / "stack" / f"{services.PREFECT_SERVER}.json")
    if record is None or not is_alive(record) or not services.http_ok(record.health_url):
        return None
    return record.health_url.removesuffix("/health")


def ensure_work_pool(config: StackConfig) -> None:
    """Create the stack's ``process`` work pool unless it exists (the CLI fills in its job template)."""
    response = httpx.get(f"{config.prefect_api_url}/work_pools/{config.work_pool}", timeout=10.0)
    if response.is_success:
        return
    argv = [config.python, "-m", "prefect", "work-pool", "create", config.work_pool, "--type", "process"]
    result = _run(config, argv)
    # "already exists": another command created it between our check and our create, which is fine.
    if result.returncode != 0 and "already exists" not in result.stdout:
        raise StackError(f"could not create work pool {config.work_pool}:\n{result.stdout[-2000:]}")


def deploy(config: StackConfig) -> str:
    """Register every deployment of ``deployments/prefect.yaml`` with the stack's Prefect server.

    Returns Prefect's output. ``TUNEPOD_REPO_ROOT`` is set for the deploy so the deployments' pull step
    and working directory point at this repository. Raises ``StackError`` if the server is not healthy
    (run ``tunepod up``) or the deploy fails.
    """
    if not services.http_ok(f"{config.prefect_api_url}/health"):
        raise StackError(f"no healthy Prefect server at {config.prefect_api_url}: run `tunepod up` first")
    ensure_work_pool(config)
    argv = [config.python, "-m", "prefect", "--no-prompt", "deploy", "--all"]
    argv += ["--prefect-file", str(config.prefect_file)]
    result = _run(config, argv)
    if result.returncode != 0:
        raise StackError(f"prefect deploy failed (exit {result.returncode}):\n{result.stdout[-4000:]}")
    return result.stdout


def _run(config: StackConfig, argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**services.prefect_env(config), "TUNEPOD_REPO_ROOT": str(config.repo)}
    pipe, merged = subprocess.PIPE, subprocess.STDOUT
    return subprocess.run(argv, cwd=config.repo, env=env, stdout=pipe, stderr=merged, text=True, check=False)


def _ensure_running(config: StackConfig, service: Service) -> tuple[ServiceRecord, bool]:
    """The service's record, and whether this call started it (False: it was running, left alone)."""
    path = _record_path(config, service.name)
    record = ServiceRecord.read(path)
    if record is not None and is_alive(record):
        return record, False
    if service.health_url and services.http_ok(service.health_url):
        raise StackError(
            f"{service.name}: {service.health_url} already answers, but tunepod did not start that process "
            f"(no live record in {path}). Stop it, or choose another port (see `tunepod up --help`)."
        )
    log = config.logs_dir / f"{service.name}.log"
    return start_service(service, log, cwd=config.repo, record_path=path), True


def _wait_healthy(config: StackConfig, record: ServiceRecord) -> None:
    deadline = time.monotonic() + config.startup_timeout_s
    while not services.check_health(config, record.name, record.argv, record.health_url):
        if not is_alive(record):
            raise StackError(_runbook(record, "exited before it was healthy"))
        if time.monotonic() >= deadline:
            raise StackError(_runbook(record, f"not healthy after {config.startup_timeout_s:.0f}s"))
        time.sleep(_POLL_S)


def _runbook(record: ServiceRecord, what: str) -> str:
    check = record.health_url or "worker ONLINE in Prefect's API"
    # A server that cannot reach its database may log the database's URL.
    tail = redacted(tail_lines(Path(record.log), _LOG_TAIL))
    return (
        f"{record.name} (pid {record.pid}) {what} (health check: {check}).\n"
        f"Last {_LOG_TAIL} lines of {record.log}:\n{tail}\n"
        f"Full log: {record.log}. Command: {' '.join(record.argv)}"
    )


def _record_path(config: StackConfig, name: str) -> Path:
    return config.records_dir / f"{name}.json"


def _in_order(records: dict[str, ServiceRecord]) -> list[ServiceRecord]:
    return [records[name] for name in _ORDER if name in records]
