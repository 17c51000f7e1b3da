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


def progress_dir(metrics_file: Path) -> Path:
    """Where a job's ranks write their heartbeats: beside its metrics file."""
    return metrics_file.parent / PROGRESS_DIR_NAME


def heartbeat_interval_s(environ: Mapping[str, str]) -> float:
    raw = environ.get(HEARTBEAT_S_ENV, "")
    try:
        interval = float(raw) if raw else DEFAULT_HEARTBEAT_S
    except ValueError:
        raise ValueError(f"{HEARTBEAT_S_ENV}={raw!r} is not a number of seconds") from None
    if interval <= 0:
        raise ValueError(f"{HEARTBEAT_S_ENV}={raw!r} must be above 0")
    return interval


class Heartbeat:
    """The beating thread of one rank. ``advance`` is what the training loop calls: two attribute
    writes, cheap enough for every batch."""

    def __init__(self, folder: Path, rank: int, interval_s: float) -> None:
        now = time.time()
        self._file = folder / f"rank-{rank}.json"
        self._interval_s = interval_s
        self._rank = rank
        self._started_at = now
        self._advanced_at = now
        self._step: int | None = None
        self._finished = False
        self._stopped = threading.Event()
        # One write at a time, each built under the lock: the final "finished" beat is always last.
        self._writing = threading.Lock()
        self._thread = threading.Thread(target=self._beat, name=f"tunepod-heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._write()  # the first beat before the thread starts: the job is seen alive at once
        self._thread.start()
        # A rank that returns from its script without calling finish (evaluation-only ranks, an
        # early exit) must not look hung while the others carry on.
        atexit.register(self.finish)
        return self

    def advance(self, step: int | None = None) -> None:
        self._advanced_at = time.time()
        if step is not None:
            self._step = step

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
            try:
                self._write()
            except OSError:
                # A full or unreachable disk must not kill training; missed beats show as a stall.
                continue

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
