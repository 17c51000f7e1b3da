"""The defects the simulation must find: each fix of issue 28 undone again, one at a time.

A mutant puts one old behaviour back (by patching the running code, never the files); the
simulation, run over seeds with the mutant in place, must break an invariant. ``python -m simulation
--mutants`` runs them all and says which seed found each one (and fails if one goes unnoticed):
proof that the invariants can fail, and a measure of how many seeds a kind of defect needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from optuna.trial import FrozenTrial

from tunepod.hpo import tuner
from tunepod.launch import drive, lease
from tunepod.launch.paths import JobPaths
from tunepod.launch.slurm import render
from tunepod.launch.watchdog import Watchdog
from tunepod.locks import locked
from tunepod.runtime.progress import read_progress


@dataclass(frozen=True)
class Mutant:
    name: str
    defect: str
    apply: Callable[[], contextlib.AbstractContextManager[None]]


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, original)


def _leases_leak() -> contextlib.AbstractContextManager[None]:
    return _patched(tuner.Tuner, "_let_go_of_unstarted", lambda self: None)


def _half_asked_trained() -> contextlib.AbstractContextManager[None]:
    def never(trial: FrozenTrial) -> bool:
        return False

    return _patched(tuner, "_half_asked", never)


def _unfenced() -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def fenced_without_a_check(self: lease.Lease) -> Iterator[None]:
        with locked(JobPaths(self.job_dir).lease_lock):
            yield

    return _patched(lease.Lease, "fenced", fenced_without_a_check)


def _host_clock_trusted() -> contextlib.AbstractContextManager[None]:
    """The watchdog before: idleness and run time on the driver's wall clock alone."""

    def stall(self: Watchdog, job_id: str, now: float) -> Any:
        limit = self.limits.hang_timeout_s
        beats = [beat for beat in read_progress(self.paths.progress) if not beat.finished]
        stalled = [beat for beat in beats if limit is not None and now - beat.advanced_at > limit]
        return _OldStall(stalled) if stalled else None

    def timed_out(self: Watchdog, job_id: str, now: float) -> bool:
        limit = self.limits.timeout_s
        return limit is not None and now - self.running_since(job_id) > limit

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(Watchdog, "stall", stall))
    stack.enter_context(_patched(Watchdog, "timed_out", timed_out))
    return stack  # type: ignore[return-value]


@dataclass(frozen=True)
class _OldStall:
    beats: list[Any]

    def describe(self) -> str:
        return f"{len(self.beats)} rank(s) stalled (by the driver's wall clock)"


def _purged_is_failed() -> contextlib.AbstractContextManager[None]:
    return _patched(render, "exit_code_trap", lambda paths: [])


def _decided_stop_wins() -> contextlib.AbstractContextManager[None]:
    return _patched(drive.JobDriver, "_ended_on_its_own", lambda self, state: False)


MUTANTS = [
    Mutant("leases-leak", "issue 28, 2: leases of trials a failed ask never started stay held", _leases_leak),
    Mutant(
        "half-asked",
        "issue 28, 5: a trial a failed ask left behind is trained on defaults",
        _half_asked_trained,
    ),
    Mutant(
        "unfenced", "issue 28, 9: a driver whose lease was taken acts until its heartbeat notices", _unfenced
    ),
    Mutant(
        "host-clock",
        "issue 28, 8 and clock jumps: the watchdog trusts the driver's wall clock",
        _host_clock_trusted,
    ),
    Mutant("purged-failed", "a job Slurm purged after it exited 0 is read as FAILED", _purged_is_failed),
    Mutant(
        "late-stop",
        "a job that finished before a decided stop reached it is counted as stopped",
        _decided_stop_wins,
    ),
]


def mutant(name: str) -> Mutant:
    found = [m for m in MUTANTS if m.name == name]
    if not found:
        raise SystemExit(f"no mutant {name!r}; the mutants: {', '.join(m.name for m in MUTANTS)}")
    return found[0]
