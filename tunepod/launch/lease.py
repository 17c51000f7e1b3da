"""One driver per job dir: a lease, renewed by a heartbeat while the driver that holds it lives, and a
fence around every action the driver takes on the job.

Two orchestrators on one study (``tunepod run`` twice, or a Prefect retry of a step whose first
attempt is still driving jobs) must never both follow, prune or resubmit one job. Whoever drives a job
dir first takes its lease (``<job_dir>/lease.json``); a background thread renews every lease this
process holds every ``ttl_s / 3`` seconds. Another driver takes the lease only once it has expired:
not renewed for ``ttl_s`` seconds, or at once when its holder is certainly gone (it ran on this
machine, in this PID namespace, and that process is not there any more: a SIGKILLed orchestrator
need not be waited for, and a pid is never looked up across containers, where the same pid names
another process).

Every read-modify-write of a lease happens under an exclusive ``flock`` of ``<job_dir>/.lease.lock``
(``tunepod.locks``), so two drivers never both see a lease free and both take it. (On Lustre this
needs the ``flock`` mount option, which FSx for Lustre clients use by default.)

**Fencing.** Each acquisition gets the next ``generation`` of the job dir's lease. A driver acts on
its job (submits, stops, restarts it, records a decision in the job dir or in Optuna) only inside
``Lease.fenced()``: under the same lock, having checked that the lease file still names its owner
and generation. So a holder that stalled past its TTL while another took over acts no more, at its
very next action (``LeaseLost``), not a heartbeat later; and while an action runs, nobody can take
the lease (the lock is held), so no action is ever half done by a holder that lost it. Taking and
renewing never wait for that lock: a lease whose lock is held is being acted on by a live holder.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from tunepod import world
from tunepod.errors import JobError
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import make_job_dir
from tunepod.locks import locked, try_locked
from tunepod.runtime.files import write_bytes_atomic

logger = logging.getLogger(__name__)

DEFAULT_TTL_S = 60.0


class LeaseLost(JobError):
    """Another driver took this job dir's lease (this one stalled past its TTL); it drives it now."""


class LeaseRecord(BaseModel):
    """``<job_dir>/lease.json``: who drives the job, and until when the lease holds without renewal."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    owner: str
    host: str
    pid: int
    pid_start_ticks: int
    boot_id: str = ""
    pid_namespace: str = ""
    renewed_at: float
    """``time()`` of the last renewal, on the holder's clock."""
    ttl_s: float
    generation: int = 0
    """Counts the acquisitions of this job dir's lease: the fencing token (see the module docstring)."""
    released: bool = False
    """Given up by its holder; the record stays so that the next generation follows this one."""

    @property
    def process(self) -> world.ProcessId:
        return world.ProcessId(self.host, self.pid, self.pid_start_ticks, self.boot_id, self.pid_namespace)

    def describe(self) -> str:
        age = max(0.0, world.time() - self.renewed_at)
        return f"driver {self.owner} (pid {self.pid} on {self.host}, renewed {age:.0f}s ago)"

    def is_live(self) -> bool:
        """Whether the holder still holds it: not released, renewed within ``ttl_s``, and not gone."""
        if self.released or world.time() - self.renewed_at > self.ttl_s:
            return False
        return not world.is_gone(self.process)


class Lease:
    """A lease this process holds on one job dir. ``lost`` turns True when another driver took it."""

    def __init__(self, leases: Leases, job_dir: Path, generation: int) -> None:
        self.leases = leases
        self.job_dir = job_dir
        self.generation = generation
        self.lost = False
        # One thread of this process inside the fence at a time, re-entrant for that thread: a second
        # thread (a promotion beside the driver still recording its pause) waits for the first to leave.
        self._fence_thread = world.rlock()
        self._fence_depth = 0

    def release(self) -> None:
        """Give the lease up (a no-op once lost). Safe to call twice."""
        self.leases.release(self)

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """Act on the job inside this block: it runs under the job dir's lease lock, once this lease
        is known to be the current one. ``LeaseLost`` (and nothing done) when another driver took it.
        Re-entrant for the thread inside it; another thread of this process waits for that one to
        leave (the depth counts one thread's re-entries, never two threads')."""
        with self._fence_thread:
            if self._fence_depth:
                self._fence_depth += 1
                try:
                    yield
                finally:
                    self._fence_depth -= 1
                return
            with locked(JobPaths(self.job_dir).lease_lock):
                self.leases.check(self)
                self._fence_depth = 1
                try:
                    yield
                finally:
                    self._fence_depth = 0

    def check(self) -> None:
        """``LeaseLost`` unless this lease is still the job dir's current one (reads the lease file)."""
        with self.fenced():
            pass


class Leases:
    """The leases of one driver identity (``owner``). Thread safe.

    ``private_job_dirs`` is the launcher's: a job dir created here for its lease gets the mode the
    launcher would give it.
    """

    def __init__(
        self, *, private_job_dirs: bool, ttl_s: float = DEFAULT_TTL_S, owner: str | None = None
    ) -> None:
        me = world.this_process()
        self.owner = owner or f"{me.host}:{me.pid}:{world.token_hex(4)}"
        self.private_job_dirs = private_job_dirs
        self.ttl_s = ttl_s
        self._held: dict[Path, Lease] = {}
        self._lock = world.lock()

    def acquire(self, job_dir: Path, *, wait: bool = False) -> Lease | None:
        """Take the lease of ``job_dir``; None when another live driver holds it, or (unless ``wait``)
        is acting on the job right now, or when this owner holds it already: one of its own drivers
        (another thread: a trial's driver still recording its pause) drives the job dir, and a second
        caller handed the same lease would act beside it, inside the same fence."""
        if self._holds(job_dir):
            return None
        make_job_dir(job_dir, private=self.private_job_dirs)
        paths = JobPaths(job_dir)
        with _lease_lock(paths, wait=wait) as got:
            if not got or self._holds(job_dir):  # two callers of this owner at once: the first has it
                return None
            current = read_lease(paths)
            if current is not None and current.owner != self.owner and current.is_live():
                return None
            if current is not None and current.owner != self.owner and not current.released:
                logger.warning("%s: taking over the expired lease of %s", job_dir, current.describe())
            generation = current.generation + 1 if current is not None else 1
            _write(paths, self._record(generation))
            lease = Lease(self, job_dir, generation)
            with self._lock:
                self._held[job_dir] = lease
        _heartbeat().add(lease)
        return lease

    def _holds(self, job_dir: Path) -> bool:
        with self._lock:
            held = self._held.get(job_dir)
        return held is not None and not held.lost

    def holder(self, job_dir: Path) -> LeaseRecord | None:
        """The live holder of ``job_dir``'s lease other than this owner, if any."""
        current = read_lease(JobPaths(job_dir))
        if current is None or current.owner == self.owner or not current.is_live():
            return None
        return current

    def check(self, lease: Lease) -> None:
        """Under the lease lock: ``LeaseLost`` (and ``lease.lost``) unless ``lease`` is current."""
        current = read_lease(JobPaths(lease.job_dir))
        if not lease.lost and _names(current, self.owner, lease.generation):
            return
        self._lost(lease, current)
        raise LeaseLost(f"{lease.job_dir} is driven by another orchestrator now; this one acts no more on it")

    def renew(self, lease: Lease) -> None:
        """Renew ``lease`` unless its lock is held (an action of its holder, or a driver looking at
        it, is under way: the next beat renews it)."""
        paths = JobPaths(lease.job_dir)
        with _lease_lock(paths, wait=False) as got:
            if not got or lease.lost:
                return
            current = read_lease(paths)
            if _names(current, self.owner, lease.generation):
                _write(paths, self._record(lease.generation))
                return
        self._lost(lease, current)

    def release(self, lease: Lease) -> None:
        _heartbeat().discard(lease)
        with self._lock:
            if self._held.get(lease.job_dir) is lease:
                del self._held[lease.job_dir]
        if lease.lost:
            return
        paths = JobPaths(lease.job_dir)
        with _lease_lock(paths, wait=True):
            current = read_lease(paths)
            if current is not None and _names(current, self.owner, lease.generation):
                _write(paths, current.model_copy(update={"released": True}))

    def _lost(self, lease: Lease, current: LeaseRecord | None) -> None:
        if lease.lost:
            return
        lease.lost = True
        _heartbeat().discard(lease)
        taker = current.describe() if current is not None else "nobody (the lease file is gone)"
        logger.error("%s: lost the lease to %s; no longer driving it", lease.job_dir, taker)

    def _record(self, generation: int) -> LeaseRecord:
        me = world.this_process()
        return LeaseRecord(
            owner=self.owner,
            host=me.host,
            pid=me.pid,
            pid_start_ticks=me.start_ticks,
            boot_id=me.boot_id,
            pid_namespace=me.pid_namespace,
            renewed_at=world.time(),
            ttl_s=self.ttl_s,
            generation=generation,
        )


def _names(record: LeaseRecord | None, owner: str, generation: int) -> bool:
    """Whether ``record`` is the unreleased record of ``owner``'s acquisition ``generation``."""
    if record is None or record.released:
        return False
    return record.owner == owner and record.generation == generation


def read_lease(paths: JobPaths) -> LeaseRecord | None:
    """The lease of a job dir; None when there is none (or it is unreadable, which counts as free)."""
    try:
        return LeaseRecord.model_validate_json(paths.lease.read_bytes())
    except (FileNotFoundError, ValidationError):
        return None


def _write(paths: JobPaths, record: LeaseRecord) -> None:
    write_bytes_atomic(paths.lease, record.model_dump_json().encode())


@contextlib.contextmanager
def _lease_lock(paths: JobPaths, *, wait: bool) -> Iterator[bool]:
    if wait:
        with locked(paths.lease_lock):
            yield True
    else:
        with try_locked(paths.lease_lock) as got:
            yield got


class _Heartbeat:
    """One daemon thread per process renewing every held lease every ``ttl_s / 3`` seconds.

    Process-wide on purpose: a lease must outlive the call that took it as long as its driver runs
    (a Prefect task run can outlive the step that started it), and it is released by that driver.
    """

    def __init__(self) -> None:
        # A dict, not a set: renewals go in the order the leases were taken, the same on every run.
        self._leases: dict[Lease, None] = {}
        self._lock = world.lock()
        self._started = False

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._leases[lease] = None
            start, self._started = not self._started, True
        if start:
            world.start_thread(self._run, "tunepod-lease-heartbeat")

    def discard(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(lease, None)

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
            world.sleep(max(0.05, interval))


def _heartbeat() -> _Heartbeat:
    return world.process_local("tunepod.launch.lease.heartbeat", _Heartbeat)
