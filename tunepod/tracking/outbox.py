"""Tracking that can never kill a job: MLflow writes happen on one background thread, retried until
MLflow answers.

Threads that drive jobs only ``add`` a mirror (``tunepod.tracking.mirror.RunMirror``) to the outbox;
they never wait for MLflow and never see its errors. The outbox's thread syncs each waiting mirror;
when MLflow does not answer (a restarted tracking server, a network partition, a locked SQLite file),
the mirror stays waiting and the thread backs off (1 s, doubling to ``max_backoff_s``), then tries
again. A step ends with ``flush``: it waits, up to a limit, until every mirror has caught up.
"""

from __future__ import annotations

import logging
import threading
import time

from tunepod.tracking.mirror import RunMirror

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 1.0


class TrackingOutbox:
    """Mirrors waiting to be synced, and the one thread that syncs them. Thread safe."""

    # 10 s: a tracking server that is back gets its backlog within seconds, and one failed attempt
    # every 10 s costs a down server nothing.
    def __init__(self, *, max_backoff_s: float = 10.0) -> None:
        self.max_backoff_s = max_backoff_s
        self._waiting: dict[int, tuple[RunMirror, int]] = {}
        self._version = 0
        self._cond = threading.Condition()
        self._closed = False
        self._failing_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="tunepod-tracking-outbox", daemon=True)
        self._thread.start()

    def add(self, mirror: RunMirror) -> None:
        """Sync ``mirror`` soon (again, if it is waiting already: something new came up)."""
        with self._cond:
            self._version += 1
            self._waiting[id(mirror)] = (mirror, self._version)
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every mirror has caught up; False (and the waiting runs logged) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._waiting:
                remaining = deadline - time.monotonic()
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
        """Stop the thread (what is still waiting stays in the job dirs for a later run)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    @property
    def num_waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    # ------------------------------------------------------------------------------------ the thread

    def _run(self) -> None:
        backoff = _FIRST_BACKOFF_S
        while (picked := self._next()) is not None:
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

    def _next(self) -> tuple[RunMirror, int] | None:
        """The next mirror to sync: one whose run does not exist yet first (a job may be waiting
        for its MLFLOW_RUN_ID), else the one waiting longest."""
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            waiting = list(self._waiting.values())
            return next((entry for entry in waiting if entry[0].run_id is None), waiting[0])

    def _synced(self, mirror: RunMirror, version: int) -> None:
        with self._cond:
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
                    "MLflow answers again after %.0fs; catching up", time.monotonic() - self._failing_since
                )
                self._failing_since = None
            self._cond.notify_all()

    def _failed(self, mirror: RunMirror, exc: Exception) -> None:
        with self._cond:
            # Move it behind the others: one bad run must not block the rest.
            entry = self._waiting.pop(id(mirror), None)
            if entry is not None:
                self._waiting[id(mirror)] = entry
            first = self._failing_since is None
            if first:
                self._failing_since = time.monotonic()
        if first:
            logger.warning(
                "MLflow did not take the records of %s (%s: %s); the jobs run on, and their records wait "
                "and are retried",
                mirror.job_dir,
                type(exc).__name__,
                str(exc)[:500],
            )
        else:
            logger.debug("MLflow still failing for %s: %s", mirror.job_dir, exc)

    def _sleep(self, seconds: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._closed, timeout=seconds)
