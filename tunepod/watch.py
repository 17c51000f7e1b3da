"""What a person watching a run is told: steps starting, going and ending, trials starting and ending.

The pipeline and each tune step's ``Tuner`` announce what happens here; whoever shows it subscribes
with ``watching`` (``tunepod run``'s console view: ``tunepod.console``). The registry is the process's,
not a context variable's: trials run on Prefect's worker threads, which do not inherit the context of
the thread that subscribed. A watcher is called on those threads, so it must be thread-safe, and it
never fails a run: what it raises is logged and dropped.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from tunepod.outputs import TrialRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StudyStart:
    """A tune step's study as its tuner opens it."""

    step: str
    study: str
    num_trials: int
    direction: str
    """``maximize`` or ``minimize``: which way the primary objective is better."""
    metric: str
    finished: Mapping[str, int] = field(default_factory=dict)
    """Trials an earlier run ended, by ending (``TrialRecord.ending``): a rerun goes on from them."""
    best: tuple[int, float] | None = None
    """The best of them: its trial number and primary value."""


class Watcher(Protocol):
    """Told what happens in a run; every method may be called from any thread."""

    def step_started(self, step: str, uses: str) -> None: ...

    def step_ended(self, step: str, ok: bool) -> None: ...

    def study_started(self, study: StudyStart) -> None: ...

    def trial_started(self, step: str, number: int) -> None: ...

    def trial_ended(self, step: str, record: TrialRecord) -> None: ...

    def step_progress(self, step: str, done: float, total: float, unit: str) -> None: ...


_watchers: list[Watcher] = []
_lock = threading.Lock()
_step: contextvars.ContextVar[str | None] = contextvars.ContextVar("tunepod_step", default=None)


@contextlib.contextmanager
def watching(watcher: Watcher) -> Iterator[Watcher]:
    """Tell ``watcher`` what happens in this process for the duration of the block."""
    with _lock:
        _watchers.append(watcher)
    try:
        yield watcher
    finally:
        with _lock:
            _watchers.remove(watcher)


@contextlib.contextmanager
def in_step(step: str) -> Iterator[None]:
    """Within the block (on this thread), ``progress`` counts towards step ``step``."""
    token = _step.set(step)
    try:
        yield
    finally:
        _step.reset(token)


def progress(total: float, unit: str) -> Callable[[float], None]:
    """A counter of a long piece of the current step's work (``in_step``): call it with each amount
    done, from any thread; it tells watchers how far it got each time (a watcher keeps the latest and
    shows it at its own pace). Outside a step, or with no watcher, it counts nothing."""
    step = _step.get()
    with _lock:
        watched = bool(_watchers)
    if step is None or not watched:
        return _count_nothing
    counted = _Progress(step, total, unit)
    counted(0)
    return counted


class _Progress:
    def __init__(self, step: str, total: float, unit: str) -> None:
        self.step, self.total, self.unit = step, total, unit
        self.done = 0.0
        self.lock = threading.Lock()

    def __call__(self, amount: float) -> None:
        with self.lock:
            self.done += amount
            done = self.done
        _tell("step_progress", self.step, done, self.total, self.unit)


def _count_nothing(amount: float) -> None:
    del amount


def step_started(step: str, uses: str) -> None:
    _tell("step_started", step, uses)


def step_ended(step: str, ok: bool) -> None:
    _tell("step_ended", step, ok)


def study_started(study: StudyStart) -> None:
    _tell("study_started", study)


def trial_started(step: str, number: int) -> None:
    _tell("trial_started", step, number)


def trial_ended(step: str, record: TrialRecord) -> None:
    _tell("trial_ended", step, record)


def _tell(event: str, *args: object) -> None:
    with _lock:
        watchers = list(_watchers)
    for watcher in watchers:
        try:
            getattr(watcher, event)(*args)
        except Exception:  # a view that breaks must not stop a study
            log.warning("a run watcher failed on %s; the run goes on", event, exc_info=True)
