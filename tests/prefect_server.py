"""One real Prefect server for the whole test session, shared by every pytest-xdist worker.

Each worker used to start one of its own (``prefect_test_harness``): the server's imports and boot cost
40-60 s of CPU each on a 2-core machine the suite keeps busy, three times over. Now the first worker
that needs the server starts it, under a lock in the session's shared temp folder, and writes its
address there; the others wait on the lock and use it; the controlling process (the one that is not
a worker, or the only process without xdist) stops it when the session ends. Started and stopped as
``tunepod up`` and ``down`` do their services (``tunepod.stack.processes``): detached, recorded, and
stopped with SIGTERM, then SIGKILL after a grace period.

The server is the one the harness starts: Prefect's API app under uvicorn in ephemeral mode (no UI,
only the services an ephemeral server runs). Its database is a new one on the PostgreSQL test server
when that runs (always under ``make test``: three workers write to it at once, which is what Prefect
recommends PostgreSQL for), else SQLite in the session folder. Prefect's migrations create either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from ports import free_port
from postgres import URL_FILE

from tunepod.stack.processes import Service, ServiceRecord, is_alive, start_service, stop_service

START_LIMIT_S = 240.0  # bound on the boot (migrations included) of a busy machine: not a speed check
STATE_NAME = "prefect-server.json"
RECORD_NAME = "prefect-server.service.json"


@dataclasses.dataclass
class SessionServer:
    """What the workers and the controller know of the session's server (its state file, as JSON)."""

    api_url: str
    admin_url: str
    """The PostgreSQL login that created ``database`` and drops it; empty on SQLite."""
    database: str
    error: str = ""
    """Why it did not start, with its log; empty once it answers."""

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def load(cls, path: Path) -> SessionServer:
        return cls(**json.loads(path.read_text()))


def shared_server(session_folder: Path) -> str:
    """The session server's API URL, starting the server if no worker has yet. The lock is held until
    it answers, so a worker never gets the address of a server still booting; a server that did not
    start fails every worker's tests with its log."""
    state = session_folder / STATE_NAME
    with _locked(session_folder / "prefect-server.lock"):
        if not state.exists():
            port = free_port()
            admin_url, database, database_url = _new_database(session_folder)
            server = SessionServer(f"http://127.0.0.1:{port}/api", admin_url, database)
            server.save(state)  # before the start, so that the controller drops the database whatever comes
            record = start_service(
                _service(port, database_url), session_folder / "prefect-server.log", Path.cwd(),
                session_folder / RECORD_NAME,
            )  # fmt: skip
            server.error = _not_ready(record)
            server.save(state)
        server = SessionServer.load(state)
    if server.error:
        raise RuntimeError(server.error)
    return server.api_url


def stop_shared_server(session_folder: Path) -> None:
    """Stop the session's server, if one started, and drop its PostgreSQL database."""
    state = session_folder / STATE_NAME
    if not state.exists():
        return
    server = SessionServer.load(state)
    state.unlink()
    record = ServiceRecord.read(session_folder / RECORD_NAME)
    if record is not None:
        stop_service(record)
    if server.admin_url:
        import psycopg

        try:
            with psycopg.connect(server.admin_url, autocommit=True, connect_timeout=5) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{server.database}" WITH (FORCE)')
        except psycopg.OperationalError as exc:  # a database left behind harms nothing: say so, go on
            print(f"warning: could not drop the session's Prefect database {server.database}: {exc}")


def task_runs_of(client: Any, flow_run_id: Any) -> list[Any]:
    """The task runs of one flow run, filtered by the server: the session's server holds other tests'
    runs too, and an unfiltered read returns only its first page of them."""
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    runs: list[Any] = client.read_task_runs(
        task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]))
    )
    return runs


def drain_prefect_clients() -> None:
    """Send the logs and events this process's Prefect client still holds, while the server is up (as
    Prefect's harness does): they are otherwise flushed at exit, after the server has stopped."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    with contextlib.suppress(RuntimeError):  # no log was ever sent: the worker never started
        APILogWorker.instance().drain()
    EventsWorker.drain_all()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _new_database(session_folder: Path) -> tuple[str, str, str]:
    """(admin URL, database name, Prefect's connection URL): a new PostgreSQL database on the test
    server when it answers, else a SQLite file (admin URL and name empty)."""
    sqlite = ("", "", f"sqlite+aiosqlite:///{session_folder / 'prefect.db'}")
    try:
        admin_url = URL_FILE.read_text().strip()
    except OSError:
        return sqlite
    import psycopg

    name = f"prefect_{secrets.token_hex(4)}"
    try:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError:
        return sqlite
    server = admin_url.split("://", 1)[1].rsplit("/", 1)[0]
    return admin_url, name, f"postgresql+asyncpg://{server}/{name}"


def _service(port: int, database_url: str) -> Service:
    """The app Prefect's harness serves: its API under uvicorn in ephemeral mode (no UI, only the
    services an ephemeral server runs)."""
    argv = [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url,
    }
    url = f"http://127.0.0.1:{port}/api"
    return Service("prefect-server", argv, env, url, f"{url}/health")


def _not_ready(record: ServiceRecord) -> str:
    """Wait until the server answers: ``""`` then, else (it exited, or did not answer within
    ``START_LIMIT_S``) what went wrong, with its log."""
    deadline = time.monotonic() + START_LIMIT_S
    while is_alive(record) and time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(record.health_url, timeout=5).status_code == 200:
                return ""
        time.sleep(0.2)
    log = Path(record.log).read_text(errors="replace")[-4000:]
    return f"the session's Prefect server did not answer {record.health_url}:\n{log}"
