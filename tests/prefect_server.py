"""One real Prefect server for the whole test session, shared by every pytest-xdist worker.

Each worker used to start one of its own (``prefect_test_harness``): the server's imports and boot cost
40-60 s of CPU each on a 2-core machine the suite keeps busy, three times over. Now the first worker
that needs the server starts it, under a lock in the session's shared temp folder, and writes its
address there; the others wait on the lock and use it; the controlling process (the one that is not
a worker, or the only process without xdist) stops it when the session ends.

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
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from ports import free_port
from postgres import URL_FILE

from tunepod.launch.procfs import read_process_stat

START_LIMIT_S = 240.0  # bound on the boot (migrations included) of a busy machine: not a speed check
STOP_GRACE_S = 10.0
STATE_NAME = "prefect-server.json"

_STARTED_HERE: subprocess.Popen[bytes] | None = None


@dataclasses.dataclass
class SessionServer:
    """What the workers and the controller know of the session's server (its state file, as JSON)."""

    api_url: str
    pid: int
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
            started = _start(session_folder)
            started.save(state)  # at once, so that the controller stops it whatever comes next
            started.error = _not_ready(started, session_folder)
            started.save(state)
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
    _stop_group(server.pid)
    if server.admin_url:
        import psycopg

        try:
            with psycopg.connect(server.admin_url, autocommit=True, connect_timeout=5) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{server.database}" WITH (FORCE)')
        except psycopg.OperationalError as exc:  # a database left behind harms nothing: say so, go on
            print(f"warning: could not drop the session's Prefect database {server.database}: {exc}")


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


def _start(session_folder: Path) -> SessionServer:
    port = free_port()
    admin_url, database, database_url = _new_database(session_folder)
    argv = [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app"]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "error", "--lifespan", "on"]
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",  # as the harness: no UI, an ephemeral server's services only
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url,
    }
    global _STARTED_HERE
    with (session_folder / "prefect-server.log").open("ab") as log:
        process = _STARTED_HERE = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives the worker that started it; the controller stops it
        )  # fmt: skip
    return SessionServer(f"http://127.0.0.1:{port}/api", process.pid, admin_url, database)


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


def _not_ready(server: SessionServer, session_folder: Path) -> str:
    """Wait until the server answers: ``""`` then, else (it exited, or did not answer within
    ``START_LIMIT_S``) what went wrong, with its log."""
    deadline = time.monotonic() + START_LIMIT_S
    health = f"{server.api_url}/health"
    while _running(server.pid) and time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(health, timeout=5).status_code == 200:
                return ""
        time.sleep(0.2)
    log = (session_folder / "prefect-server.log").read_text(errors="replace")[-4000:]
    return f"the session's Prefect server did not answer {health}:\n{log}"


def _stop_group(pid: int) -> None:
    """SIGTERM the server's process group, SIGKILL after ``STOP_GRACE_S``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _running(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    if _STARTED_HERE is not None:  # without xdist this process is its parent: reap it
        _STARTED_HERE.wait()


def _running(pid: int) -> bool:
    """Whether ``pid`` has not exited (a zombie, whose parent worker has not reaped it, has)."""
    stat = read_process_stat(pid)
    return stat is not None and not stat.is_dead
