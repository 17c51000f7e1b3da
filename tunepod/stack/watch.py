"""What ``tunepod run`` does about a Prefect server that goes away mid-run (killed, restarted, rebooted).

Nothing a pipeline computes lives in Prefect: jobs run in their own sessions, trials are told from
their job dirs, the study is in its Optuna storage and tracking in MLflow. A running flow needs the API
only for its bookkeeping: log batches, task-run events (Prefect buffers and resends them once the
server answers again), artifacts and the flow run's own states. So a run rides out an outage when each
of those calls waits long enough (``CLIENT_MAX_RETRIES``), and says plainly what happened
(``ServerWatch``, ``lost_server``) instead of showing Prefect's tracebacks.

Never imports Prefect: the watch asks the server's ``/health`` over plain HTTP.
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType

import httpx

logger = logging.getLogger(__name__)

CLIENT_MAX_RETRIES = 7
"""``PREFECT_CLIENT_MAX_RETRIES`` for runs (unless set): Prefect's client backs off 2, 4, ... 128 s, so
a call waits about 4 minutes (254 s) for a restarted server, where its default of 5 gives up after
about a minute, less than a busy machine takes to start Prefect's server again."""
RESTART_HINT = "`tunepod up` starts the local stack's server again and leaves what runs alone"


TEMPORARY_SERVER_BOOT_S = 120
"""Seconds a run gives Prefect's temporary server to boot (Prefect's own default: 20)."""


def run_environment_defaults() -> dict[str, str]:
    """Prefect settings every run gets unless the user set them (the stack's runner starts with them too,
    so that its Prefect settings are those of the runs it forks)."""
    return {
        # The temporary server's telemetry heartbeat races the flow's first writes to its SQLite file
        # and prints a "database is locked" traceback; nothing could be sent from a closed network.
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_CLIENT_MAX_RETRIES": str(CLIENT_MAX_RETRIES),
        # Prefect gives its temporary server 20 s to boot; on a laptop busy with the run's own jobs (or
        # a host stealing a fifth of its CPU) that failed whole runs before their first trial.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(TEMPORARY_SERVER_BOOT_S),
    }


_POLL_S = 5.0
_HEALTH_TIMEOUT_S = 3.0
#: Where Prefect's flow engine logs a flow's exception, with its traceback (a logger name: no import).
_FLOW_RUN_LOGGER = "prefect.flow_runs"


def rerun_advice(api: str) -> str:
    """What to do once a run stopped because the Prefect server at ``api`` stayed away."""
    return (
        f"Start the Prefect server at {api} again ({RESTART_HINT}) and run the same command again: "
        "it re-attaches to jobs that still run and trains no finished trial again (job dirs, the "
        "study and MLflow keep them). The flow run it lost stays Running in Prefect's UI."
    )


def lost_server(exc: BaseException) -> httpx.TransportError | None:
    """The connection error behind ``exc`` (itself, or a cause or context of it) when a call to the
    Prefect API failed for want of a server; None for any other failure."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, httpx.TransportError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


class _NoTracebackForLostServer(logging.Filter):
    """Keeps the one line of a log record whose exception is a lost connection, drops its traceback:
    the watch and ``tunepod run`` say what happened and what to do in words."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and lost_server(record.exc_info[1]):
            record.exc_info = None
            record.exc_text = None
        return True


class ServerWatch:
    """Asks ``<api>/health`` every few seconds from a daemon thread while a run goes on, and logs a
    warning once when the server stops answering (what goes on, what to do) and once when it answers
    again. Use it as a context manager around the run; it only reports, and it keeps Prefect's flow
    logger from printing a traceback for a lost connection meanwhile."""

    def __init__(self, api: str, poll_s: float = _POLL_S) -> None:
        self.api = api.rstrip("/")
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="prefect-server-watch", daemon=True)
        self._down_since: float | None = None
        self._quiet = _NoTracebackForLostServer()

    def __enter__(self) -> ServerWatch:
        logging.getLogger(_FLOW_RUN_LOGGER).addFilter(self._quiet)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=_HEALTH_TIMEOUT_S + 1.0)
        logging.getLogger(_FLOW_RUN_LOGGER).removeFilter(self._quiet)
        if self._down_since is not None:
            # The run may end within a poll of the server's return: say it was back, or still away.
            self._check()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._check()

    def _check(self) -> None:
        """Ask the server once; log when that changes what the last answer said."""
        problem = self._health_problem()
        if problem is not None and self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "Prefect server %s does not answer (%s). Training goes on: jobs, trials, the study "
                "and MLflow do not need it, and Prefect's client retries each call for about 4 "
                "minutes. Start it again: %s.",
                self.api, problem, RESTART_HINT,
            )  # fmt: skip
        elif problem is None and self._down_since is not None:
            down_s = time.monotonic() - self._down_since
            self._down_since = None
            logger.warning("Prefect server %s answers again after %.0fs down", self.api, down_s)

    def _health_problem(self) -> str | None:
        """Why the server is not healthy now, or None when ``/health`` answers 2xx."""
        try:
            response = httpx.get(f"{self.api}/health", timeout=_HEALTH_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if response.is_success else f"/health answered HTTP {response.status_code}"
