"""A Prefect server for one ``tunepod run``, when no server is set and no local stack runs.

Prefect would start a temporary server itself, inside the flow call, after importing its server
package in the caller: seconds of CPU on the run's own interpreter lock, and only then the server's
own seconds of booting. Started here instead, first thing, as ``python -m prefect server start`` (the
same command ``tunepod up`` runs, without its UI, scheduler and late-run services, which a run of one
flow has no use for) in a process of its own: it boots on another core while the run imports Prefect's
client, MLflow and Optuna, and the run never imports Prefect's server. Like Prefect's, it keeps its
runs in the profile's database (``~/.prefect/prefect.db`` unless set otherwise) and stops with the run.

Its process dies with the run: SIGTERM at the end (SIGKILL after ``STOP_GRACE_S``), and the kernel's
parent-death signal if the run itself is killed. Its output goes to a log file, shown when it fails.

Never imports Prefect: the server is a command, and readiness is its ``/api/health`` over HTTP.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tunepod.errors import TunepodError
from tunepod.stack.processes import signal_group

HOST = "127.0.0.1"
STOP_GRACE_S = 5.0
_POLL_S = 0.1
_PR_SET_PDEATHSIG = 1
_SERVICES_OFF = ("--no-ui", "--no-scheduler", "--no-late-runs", "--analytics-off")


class TemporaryServerError(TunepodError):
    """The temporary Prefect server did not start (the message has its log's last lines)."""


class TemporaryServer:
    """``python -m prefect server start`` on a free loopback port; ``api_url`` for PREFECT_API_URL."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.process = process
        self.port = port
        self.log = log
        self.api_url = f"http://{HOST}:{port}/api"
        self._log_shown = False  # a log named in an error stays for its reader

    @classmethod
    def start(cls, env: dict[str, str] | None = None) -> TemporaryServer:
        """Start the server (not waiting for it). Call from the main thread: the parent-death signal
        is tied to the thread that starts the process."""
        port = _free_port()
        argv = [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(port)]
        descriptor, name = tempfile.mkstemp(prefix="tunepod-prefect-server-", suffix=".log")
        log = Path(name)
        with os.fdopen(descriptor, "wb") as output:
            process = subprocess.Popen(
                [*argv, *_SERVICES_OFF],
                env=os.environ.copy() if env is None else env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its process group: Ctrl-C goes to the run, which stops it
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        return cls(process, port, log)

    def wait_until_ready(self, timeout_s: float) -> None:
        """Return once the server answers ``/api/health``; ``TemporaryServerError`` if it exits first
        or does not answer within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise self._failed(f"exited with {self.process.returncode} while starting")
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(_POLL_S)
        timed_out = self._failed(f"did not answer {self.api_url}/health within {timeout_s:.0f}s")
        self.stop()
        raise timed_out

    def stop(self) -> None:
        """SIGTERM its process group, SIGKILL after ``STOP_GRACE_S``; remove its log unless an error
        named it."""
        if self.process.poll() is None:
            signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if not self._log_shown:
            self.log.unlink(missing_ok=True)

    def _failed(self, what: str) -> TemporaryServerError:
        self._log_shown = True
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        return TemporaryServerError(
            f"the temporary Prefect server for this run {what}; its log, {self.log}, ends with:\n{tail}\n"
            "    fix: start one that stays up with `tunepod up` (or point PREFECT_API_URL at a server)"
        )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the process that started it dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
