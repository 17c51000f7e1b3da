"""One driver per job dir: a lease, renewed by a heartbeat while the driver that holds it lives.

Two orchestrators on one study (``tunepod run`` twice, or a Prefect retry of a step whose first
attempt is still driving jobs) must never both follow, prune or resubmit one job. Whoever drives a job
dir first takes its lease (``<job_dir>/lease.json``); a background thread renews every lease this
process holds every ``ttl_s / 3`` seconds. Another driver takes the lease only once it has expired:
not renewed for ``ttl_s`` seconds, or at once when its holder ran on this host and that process is
gone (a SIGKILLed orchestrator need not be waited for).

Every read-modify-write of a lease happens under an exclusive ``flock`` of ``<job_dir>/.lease.lock``,
so two drivers never both see a lease free and both take it. (On Lustre this needs the ``flock`` mount
option, which FSx for Lustre clients use by default.)

A holder that could not renew in time (a stopped process) may find its lease taken: ``Lease.lost``
then turns True, and its driver stops driving that job without touching it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from tunepod.launch.paths import JobPaths
from tunepod.launch.procfs import is_same_process, read_process_stat
from tunepod.launch.submission import make_job_dir
from tunepod.locks import locked
from tunepod.runtime.files import write_bytes_atomic

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 60.0


class LeaseRecord(BaseModel):
    """``<job_dir>/lease.json``: who drives the job, and until when the lease holds without renewal."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    owner: str
    host: str
    pid: int
    pid_start_ticks: int
    renewed_at: float
    """``time.time()`` of the last renewal, on the holder's clock."""
    ttl_s: float

    def describe(self) -> str:
        age = max(0.0, time.time() - self.renewed_at)
        return f"driver {self.owner} (pid {self.pid} on {self.host}, renewed {age:.0f}s ago)"

    def is_live(self) -> bool:
        """Whether the holder still holds it: renewed within ``ttl_s``, and alive if on this host."""
        if time.time() - self.renewed_at > self.ttl_s:
            return False
        return self.host != socket.gethostname() or is_same_process(self.pid, self.pid_start_ticks)


class Lease:
    """A lease this process holds on one job dir. ``lost`` turns True when another driver took it."""

    def __init__(self, leases: Leases, job_dir: Path) -> None:
        self.leases = leases
        self.job_dir = job_dir
        self.lost = False

    def release(self) -> None:
        """Give the lease up (a no-op once lost). Safe to call twice."""
        self.leases.release(self)


class Leases:
    """The leases of one driver identity (``owner``). Thread safe.

    ``private_job_dirs`` is the launcher's: a job dir created here for its lease gets the mode the
    launcher would give it.
    """

    def __init__(
        self, *, private_job_dirs: bool, ttl_s: float = DEFAULT_TTL_S, owner: str | None = None
    ) -> None:
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.private_job_dirs = private_job_dirs
        self.ttl_s = ttl_s
        self._held: dict[Path, Lease] = {}
        self._lock = threading.Lock()

    def acquire(self, job_dir: Path) -> Lease | None:
        """Take the lease of ``job_dir`` (the same ``Lease`` again when this owner holds it already);
        None when another live driver holds it."""
        with self._lock:
            held = self._held.get(job_dir)
        if held is not None and not held.lost:
            return held
        make_job_dir(job_dir, private=self.private_job_dirs)
        paths = JobPaths(job_dir)
        with _locked(paths):
            current = read_lease(paths)
            if current is not None and current.owner != self.owner and current.is_live():
                return None
            if current is not None and current.owner != self.owner:
                logger.warning("%s: taking over the expired lease of %s", job_dir, current.describe())
            _write(paths, self._record())
        lease = Lease(self, job_dir)
        with self._lock:
            self._held[job_dir] = lease
        _heartbeat().add(lease)
        return lease

    def holder(self, job_dir: Path) -> LeaseRecord | None:
        """The live holder of ``job_dir``'s lease other than this owner, if any."""
        current = read_lease(JobPaths(job_dir))
        if current is None or current.owner == self.owner or not current.is_live():
            return None
        return current

    def renew(self, lease: Lease) -> None:
        paths = JobPaths(lease.job_dir)
        with _locked(paths):
            current = read_lease(paths)
            if current is None or current.owner != self.owner:
                lease.lost = True
            else:
                _write(paths, self._record())
        if lease.lost:
            _heartbeat().discard(lease)
            taker = current.describe() if current is not None else "nobody (the lease file is gone)"
            logger.error("%s: lost the lease to %s; no longer driving it", lease.job_dir, taker)

    def release(self, lease: Lease) -> None:
        _heartbeat().discard(lease)
        with self._lock:
            if self._held.get(lease.job_dir) is lease:
                del self._held[lease.job_dir]
        if lease.lost:
            return
        paths = JobPaths(lease.job_dir)
        with _locked(paths):
            current = read_lease(paths)
            if current is not None and current.owner == self.owner:
                paths.lease.unlink(missing_ok=True)

    def _record(self) -> LeaseRecord:
        stat = read_process_stat(os.getpid())
        return LeaseRecord(
            owner=self.owner,
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_start_ticks=stat.start_ticks if stat is not None else 0,
            renewed_at=time.time(),
            ttl_s=self.ttl_s,
        )


def read_lease(paths: JobPaths) -> LeaseRecord | None:
    """The lease of a job dir; None when there is none (or it is unreadable, which counts as free)."""
    try:
        return LeaseRecord.model_validate_json(paths.lease.read_bytes())
    except (FileNotFoundError, ValidationError):
        return None


def _write(paths: JobPaths, record: LeaseRecord) -> None:
    write_bytes_atomic(paths.lease, record.model_dump_json().encode())


def _locked(paths: JobPaths) -> contextlib.AbstractContextManager[None]:
    return locked(paths.lease_lock)


class _Heartbeat:
    """One daemon thread per process renewing every held lease every ``ttl_s / 3`` seconds.

    Process-wide on purpose: a lease must outlive the call that took it as long as its driver runs
    (a Prefect task run can outlive the step that started it), and it is released by that driver.
    """

    def __init__(self) -> None:
        self._leases: set[Lease] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._leases.add(lease)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tunepod-lease-heartbeat", daemon=True)
                self._thread.start()

    def discard(self, lease: Lease) -> None:
        with self._lock:
            self._leases.discard(lease)

    def _run(self) -> None:
        while True:
            with self._lock:
                leases = list(self._leases)
            interval = min((lease.leases.ttl_s for lease in leases), default=DEFAULT_TTL_S) / 3
            for lease in leases:
                try:
                    lease.leases.renew(lease)
                except OSError as exc:
                    # A shared filesystem hiccup: the next beat tries again, well within the TTL.
                    logger.warning("%s: could not renew the lease: %s", lease.job_dir, exc)
            time.sleep(max(0.05, interval))


_HEARTBEAT = _Heartbeat()


def _heartbeat() -> _Heartbeat:
    return _HEARTBEAT
