"""Per-rank heartbeats: how the orchestrator tells a hung job from a slow one.

Every rank of a job runs one daemon thread that rewrites ``progress/rank-<N>.json`` (beside the
metrics file) every ``TUNEPOD_HEARTBEAT_S`` seconds. The file says when the thread last wrote
(``beat_at``: the process is alive) and when the training loop last advanced (``advanced_at``: it
called ``report``, ``save_checkpoint``, ``load_latest_checkpoint`` or ``heartbeat``). A loop stuck in
a collective, or on a hung mount, stops advancing while its thread keeps beating; a killed or frozen
process stops beating too. Times are the job host's wall clock (``time.time()``), so an orchestrator
that restarts, or runs on another host, reads the same history.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from tunepod.runtime.files import write_bytes_atomic

HEARTBEAT_S_ENV = "TUNEPOD_HEARTBEAT_S"
PROGRESS_LOG_S_ENV = "TUNEPOD_PROGRESS_LOG_S"
"""Set (by a launcher whose backend watches logs for hangs, HyperPod EKS): print a progress line at
start and then at most this often while the loop advances. Unset: print nothing."""
PROGRESS_LOG_PREFIX = "tunepod progress:"
DEFAULT_HEARTBEAT_S = 10.0
PROGRESS_DIR_NAME = "progress"


@dataclass(frozen=True)
class RankProgress:
    """One rank's last heartbeat."""

    rank: int
    host: str
    pid: int
    started_at: float
    """When this process's heartbeat began (``runtime.init``)."""
    beat_at: float
    """When the heartbeat thread last wrote: the process was alive then."""
    advanced_at: float
    """When the training loop last advanced."""
    step: int | None
    """The last step the loop named (a report, a checkpoint, ``heartbeat(step)``)."""
    interval_s: float
    """How often this rank beats: a ``beat_at`` older than a few intervals means the process is gone."""
    finished: bool = False
    """The rank's loop is over (``finish`` was called, or the process is exiting)."""
    stop_signal: str | None = None
    """The signal that asked this rank to stop (``SIGTERM``), when its script was listening for one
    (``ctx.should_stop()``): a rank that ended after it was stopped, not one that failed."""
    stop_requested_at: float | None = None


def progress_dir(metrics_file: Path) -> Path:
    """Where a job's ranks write their heartbeats: beside its metrics file."""
    return metrics_file.parent / PROGRESS_DIR_NAME


def heartbeat_interval_s(environ: Mapping[str, str]) -> float:
    interval = _seconds(environ, HEARTBEAT_S_ENV)
    return DEFAULT_HEARTBEAT_S if interval is None else interval


def progress_log_s(environ: Mapping[str, str]) -> float | None:
    return _seconds(environ, PROGRESS_LOG_S_ENV)


def _seconds(environ: Mapping[str, str], name: str) -> float | None:
    raw = environ.get(name, "")
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{name}={raw!r} must be above 0")
    return seconds


class Heartbeat:
    """The beating thread of one rank. ``advance`` is what the training loop calls: two attribute
    writes, cheap enough for every batch."""

    def __init__(self, folder: Path, rank: int, interval_s: float, log_every_s: float | None = None) -> None:
        now = time.time()
        self._log_every_s = log_every_s
        self._logged: tuple[float, float] | None = None  # (when, the advance it told of)
        self._file = folder / f"rank-{rank}.json"
        self._interval_s = interval_s
        self._rank = rank
        self._started_at = now
        self._advanced_at = now
        self._step: int | None = None
        self._finished = False
        self._stop_signal: str | None = None
        self._stop_requested_at: float | None = None
        self._stopped = threading.Event()
        # One write at a time, each built under the lock: the final "finished" beat is always last.
        self._writing = threading.Lock()
        self._thread = threading.Thread(target=self._beat, name=f"tunepod-heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._write()  # the first beat before the thread starts: the job is seen alive at once
        self._log_progress()
        self._thread.start()
        # A rank that returns from its script without calling finish (evaluation-only ranks, an
        # early exit) must not look hung while the others carry on.
        atexit.register(self.finish)
        return self

    def advance(self, step: int | None = None) -> None:
        self._advanced_at = time.time()
        if step is not None:
            self._step = step

    def stop_requested(self, signal_name: str, at: float) -> None:
        """Called from a signal handler: no lock here (the loop may hold it); the next beat says it."""
        self._stop_signal = signal_name
        self._stop_requested_at = at

    def finish(self) -> None:
        """The loop is over: one last beat says so, and the thread stops. Idempotent."""
        if self._finished:
            return
        self._finished = True
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._write()

    def _beat(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self._log_progress()
            try:
                self._write()
            except OSError:
                # A full or unreachable disk must not kill training; missed beats show as a stall.
                continue

    def _log_progress(self) -> None:
        """One line on stdout for a backend that watches logs: at start, then while the loop advances
        (never more often than ``log_every_s``); a stuck loop prints nothing, and that silence is what
        the backend's rule (``expectedRecurringFrequencyInSeconds``) detects."""
        if self._log_every_s is None:
            return
        now, advanced_at = time.time(), self._advanced_at
        if self._logged is not None:
            logged_at, told_of = self._logged
            if advanced_at == told_of or now - logged_at < self._log_every_s:
                return
        self._logged = (now, advanced_at)
        step = "-" if self._step is None else self._step
        print(f"{PROGRESS_LOG_PREFIX} rank {self._rank} step {step}", flush=True)

    def _write(self) -> None:
        with self._writing:
            beat = RankProgress(
                rank=self._rank,
                host=socket.gethostname(),
                pid=os.getpid(),
                started_at=self._started_at,
                beat_at=time.time(),
                advanced_at=self._advanced_at,
                step=self._step,
                interval_s=self._interval_s,
                finished=self._finished,
                stop_signal=self._stop_signal,
                stop_requested_at=self._stop_requested_at,
            )
            self._file.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self._file, json.dumps(asdict(beat)).encode())


def read_progress(folder: Path) -> list[RankProgress]:
    """Every rank's last heartbeat under ``folder`` (a job's ``progress`` dir), by rank; files being
    replaced or unreadable are left out (the next read sees them)."""
    found: list[RankProgress] = []
    for path in sorted(folder.glob("rank-*.json")) if folder.is_dir() else []:
        try:
            found.append(RankProgress(**json.loads(path.read_bytes())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(found, key=lambda beat: beat.rank)
