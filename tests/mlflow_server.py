"""A real ``mlflow server`` on loopback that a test can SIGKILL and start again on the same port and store.

The server runs in a session of its own, so ``kill`` takes its whole process group (the CLI, uvicorn and
its worker) down at once, the way a crashed or OOM-killed tracking server goes. Its SQLite store and
artifact folder stay, so ``start`` brings the same server back.

One uvicorn worker: the default four take ~17 s to start on two cores (~9 s with one), and one is
plenty for a test. ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` spares the job-execution workers that
tunepod never uses.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest
from ports import free_port

from tunepod.tracking.sqlite_store import seed_new_store

START_LIMIT_S = 120.0


class MlflowServer:
    """``mlflow server`` with a SQLite store and an artifact folder under ``folder``, on ``port``."""

    def __init__(self, folder: Path, port: int) -> None:
        self.folder = folder
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.folder / "mlflow-server.log"

    def start(self) -> None:
        """Start the server and wait until ``/health`` answers (bounded; fails with its log)."""
        assert self.process is None, "the MLflow server is running already"
        self.folder.mkdir(parents=True, exist_ok=True)
        # As tunepod opens a new SQLite store: a copy of the cached empty one (seconds of migrations).
        seed_new_store(f"sqlite:///{self.folder / 'mlflow.db'}")
        argv = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}"]
        argv += ["--artifacts-destination", str(self.folder / "artifacts"), "--workers", "1"]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1
        deadline = time.monotonic() + START_LIMIT_S
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(
                    f"mlflow server on port {self.port} did not start:\n{self.log.read_text()[-4000:]}"
                )
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the server's whole process group and wait until the port no longer answers."""
        if self.process is None:
            return
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None
        deadline = time.monotonic() + 30
        while self.answers():
            if time.monotonic() > deadline:
                pytest.fail(f"port {self.port} still answers 30 s after the MLflow server was killed")
            time.sleep(0.1)

    def answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).is_success
        except httpx.HTTPError:
            return False


@contextmanager
def mlflow_server(folder: Path) -> Iterator[MlflowServer]:
    """A started server on a free port; killed on exit, whatever state the test left it in."""
    server = MlflowServer(folder, free_port())
    try:
        server.start()
        yield server
    finally:
        server.kill()
