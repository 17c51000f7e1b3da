"""Tracking that can never kill a job: MLflow writes happen on background threads, retried until
MLflow answers.

Threads that drive jobs only ``add`` a mirror (``tunepod.tracking.mirror.RunMirror``) to the outbox;
they never see MLflow's errors, and wait for it only for a new run's id (bounded: a job whose run
is not there in time starts without MLFLOW_RUN_ID). The outbox's threads sync the waiting mirrors,
each mirror on one thread at a time (a mirror's ``sync`` is not reentrant), several mirrors at once:
every MLflow call is a round trip (an HTTP request to a tracking server, a SQLite transaction), and
with one thread the runs of many short trials queued behind each other. One more thread only creates
runs, so that a new trial's job never waits behind another run's reports or final record. When
MLflow does not answer (a restarted tracking server, a network partition, a locked SQLite file), the
mirror stays waiting and its thread backs off (1 s, doubling to ``max_backoff_s``), then tries
again. A step ends with ``flush``: it waits, up to a limit, until every mirror has caught up.
"""

from __future__ import annotations

import logging

from tunepod import world
from tunepod.stores import redacted
from tunepod.tracking.mirror import RunMirror

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 1.0
SYNC_THREADS = 4
"""Mirrors synced at once against a tracking server or a PostgreSQL store, which answer requests
concurrently (MLflow's server runs 4 workers under ``tunepod up``)."""


def takes_one_writer(tracking_uri: str) -> bool:
    """Whether the store takes one writer at a time (a SQLite file), not concurrent writes (a tracking
    server, a database server)."""
    return tracking_uri.startswith("sqlite:")


def sync_threads_for(tracking_uri: str) -> int:
    """How many threads sync mirrors into this store (the one that creates runs aside): one for a
    store that takes one writer at a time (measured on SQLite: four made 100 short trials slower, each
    waiting on the file's lock and retrying), ``SYNC_THREADS`` otherwise."""
    return 1 if takes_one_writer(tracking_uri) else SYNC_THREADS


class TrackingOutbox:
    """Mirrors waiting to be synced, and the threads that sync them. Thread safe."""

    # 10 s: a tracking server that is back gets its backlog within seconds, and one failed attempt
    # every 10 s costs a down server nothing.
    def __init__(self, *, max_backoff_s: float = 10.0, threads: int = SYNC_THREADS) -> None:
        self.max_backoff_s = max_backoff_s
        self._waiting: dict[int, tuple[RunMirror, int]] = {}
        self._syncing: set[int] = set()
        """Mirrors a thread is syncing now: no other thread takes them meanwhile."""
        self._version = 0
        self._cond = world.condition()
        self._closed = False
        self._failing_since: float | None = None
        self._threads_running = threads + 1
        for n in range(threads):
            world.start_thread(self._run, f"tunepod-tracking-outbox-{n}")
        world.start_thread(lambda: self._run(runs_only=True), "tunepod-tracking-outbox-runs")

    def add(self, mirror: RunMirror) -> None:
        """Sync ``mirror`` soon (again, if it is waiting already: something new came up)."""
        with self._cond:
            self._version += 1
            self._waiting[id(mirror)] = (mirror, self._version)
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every mirror has caught up; False (and the waiting runs logged) after ``timeout_s``."""
        deadline = world.monotonic() + timeout_s
        with self._cond:
            while self._waiting:
                remaining = deadline - world.monotonic()
                if remaining <= 0:
                    behind = sorted(str(mirror.job_dir) for mirror, _ in self._waiting.values())
                    logger.error(
                        "MLflow did not take the records of %d job(s) within %.0fs: %s. Their reports "
                        "wait in their metrics files; running the pipeline again brings MLflow up to date",
                        len(behind),
                        timeout_s,
                        ", ".join(behind),
                    )
                    return False
                self._cond.wait(min(remaining, 1.0))
        return True

    def close(self) -> None:
        """Stop the threads (what is still waiting stays in the job dirs for a later run)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._threads_running == 0, timeout=5)

    @property
    def num_waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    # ------------------------------------------------------------------------------------ the thread

    def _run(self, runs_only: bool = False) -> None:
        try:
            self._sync_until_closed(runs_only)
        finally:
            with self._cond:
                self._threads_running -= 1
                self._cond.notify_all()

    def _sync_until_closed(self, runs_only: bool) -> None:
        backoff = _FIRST_BACKOFF_S
        while (picked := self._next(runs_only)) is not None:
            mirror, version = picked
            try:
                mirror.sync()
            except Exception as exc:  # MLflow's errors are many; none of them may reach a job's driver
                self._failed(mirror, exc)
                self._sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                continue
            backoff = _FIRST_BACKOFF_S
            self._synced(mirror, version)

    def _next(self, runs_only: bool) -> tuple[RunMirror, int] | None:
        """The next mirror to sync that no other thread is syncing: one whose run does not exist
        yet first (a job may be waiting for its MLFLOW_RUN_ID), else (unless ``runs_only``) the one
        waiting longest."""
        with self._cond:
            while not (free := self._free(runs_only)) and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            picked = next((entry for entry in free if entry[0].run_id is None), free[0])
            self._syncing.add(id(picked[0]))
            return picked

    def _free(self, runs_only: bool) -> list[tuple[RunMirror, int]]:
        return [
            entry
            for key, entry in self._waiting.items()
            if key not in self._syncing and not (runs_only and entry[0].run_id is not None)
        ]

    def _synced(self, mirror: RunMirror, version: int) -> None:
        with self._cond:
            self._syncing.discard(id(mirror))
            current = self._waiting.get(id(mirror))
            if current is not None and current[1] == version:
                del self._waiting[id(mirror)]
            else:
                # Re-added meanwhile: move it behind the others so no mirror starves.
                self._waiting.pop(id(mirror), None)
                if current is not None:
                    self._waiting[id(mirror)] = current
            if self._failing_since is not None:
                logger.warning(
                    "MLflow answers again after %.0fs; catching up", world.monotonic() - self._failing_since
                )
                self._failing_since = None
            self._cond.notify_all()

    def _failed(self, mirror: RunMirror, exc: Exception) -> None:
        with self._cond:
            self._syncing.discard(id(mirror))
            # Move it behind the others: one bad run must not block the rest.
            entry = self._waiting.pop(id(mirror), None)
            if entry is not None:
                self._waiting[id(mirror)] = entry
            first = self._failing_since is None
            if first:
                self._failing_since = world.monotonic()
            self._cond.notify_all()  # it is free again for another thread
        # MLflow's messages may quote a tracking URI with its login: shown redacted, as every store URI.
        why = redacted(str(exc), mirror.tracker.tracking_uri)
        if first:
            logger.warning(
                "MLflow did not take the records of %s (%s: %s); the jobs run on, and their records wait "
                "and are retried",
                mirror.job_dir,
                type(exc).__name__,
                why[:500],
            )
        else:
            logger.debug("MLflow still failing for %s: %s", mirror.job_dir, why)

    def _sleep(self, seconds: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._closed, timeout=seconds)
