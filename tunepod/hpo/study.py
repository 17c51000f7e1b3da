"""Opening an Optuna study from the spec: storage, sampler, pruner and search space."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalStorage

# Optuna's journal backend takes any lock of this base; it is only importable from its module.
from optuna.storages.journal._file import BaseJournalFileLock

from tunepod.errors import TunepodError
from tunepod.runtime.files import append_whole, disk_full_explained
from tunepod.spec.models import (
    CategoricalParam,
    FloatParam,
    PrunerSpec,
    SearchParam,
    StudySpec,
    TuneSettings,
)

JOURNAL_SCHEME = "journal://"


def distributions(space: dict[str, SearchParam]) -> dict[str, BaseDistribution]:
    """The Optuna distributions of a search space, so ``study.ask`` can sample all params at once."""
    return {name: _distribution(param) for name, param in space.items()}


def _distribution(param: SearchParam) -> BaseDistribution:
    if isinstance(param, FloatParam):
        return FloatDistribution(param.low, param.high, log=param.log, step=param.step)
    if isinstance(param, CategoricalParam):
        return CategoricalDistribution(param.choices)
    return IntDistribution(param.low, param.high, log=param.log, step=param.step)


def make_storage(uri: str) -> BaseStorage:
    """``journal://<file>`` (a journal file, safe on a shared filesystem) or any SQLAlchemy URL."""
    if uri.startswith(JOURNAL_SCHEME):
        path = Path(uri[len(JOURNAL_SCHEME) :]).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(WholeLinesJournalBackend(path))
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        # Trials report from several threads at once; wait for SQLite's lock instead of failing.
        return RDBStorage(uri, engine_kwargs={"connect_args": {"timeout": 30}})
    return RDBStorage(uri)


class WholeLinesJournalBackend(JournalFileBackend):
    """Optuna's journal file, locked with ``FlockJournalLock``, whose appends are whole or absent.

    Optuna appends through a buffered file: on a full disk it leaves a torn line, the next append is
    glued onto it, and from then on the journal no longer loads. Here an append that fails is cut
    back off the file and raised as ``DiskFullError`` (or as it was), so the study keeps loading with
    every trial recorded before.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._write_lock = FlockJournalLock(path)
        super().__init__(str(path), lock_obj=self._write_lock)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        # The same bytes as Optuna's own append, so either can read what the other wrote.
        lines = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs)
        fix = (
            "free space there, or point the tune step's study.storage at a larger filesystem; the "
            "study's earlier trials are intact"
        )
        self._write_lock.acquire()
        try:
            with disk_full_explained(self._path, fix):
                append_whole(self._path, lines.encode("utf-8"))
        finally:
            self._write_lock.release()


class FlockJournalLock(BaseJournalFileLock):
    """The journal's write lock as an ``flock`` of ``<journal>.flock``.

    Several orchestrators append to one journal (``tunepod run`` twice on a study). Optuna's own file
    locks are files that a SIGKILLed writer leaves behind: every other writer then waits out a grace
    period and forces the lock, which may break a live holder's. The kernel drops an ``flock`` when
    its holder dies. One descriptor per acquire, so threads of one process exclude each other too.
    """

    def __init__(self, journal: Path) -> None:
        self._path = journal.with_name(journal.name + ".flock")
        self._held = threading.local()

    def acquire(self) -> bool:
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._held.fd = fd
        return True

    def release(self) -> None:
        os.close(self._held.fd)


def make_sampler(settings: TuneSettings, *, seed: int | None = None) -> optuna.samplers.BaseSampler:
    """The study's sampler; ``seed`` (default: the spec's) seeds its random numbers."""
    seed = settings.seed if seed is None else seed
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if settings.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    # Multivariate TPE with the constant liar, so trials in flight are not suggested twice.
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)


def reseed_for_next_trial(study: optuna.Study, settings: TuneSettings, num_trials: int) -> None:
    """With a seed, make the sampler of the next ask depend on the seed AND on how many trials the
    study holds: a rerun, or a second orchestrator on the study, then continues the sequence instead
    of suggesting the first trials' parameters again, and one orchestrator stays reproducible."""
    if settings.seed is not None:
        study.sampler = make_sampler(settings, seed=settings.seed + num_trials)


class ThreadSafeHyperbandPruner(optuna.pruners.HyperbandPruner):
    """Optuna's Hyperband pruner, safe to ask from every trial's driver thread at once.

    It builds its brackets on first use; two threads doing that together double its budgets and then
    fail with "This line should be unreachable". One re-entrant lock covers ``prune`` and the bracket
    lookup Optuna's samplers also call (``optuna.pruners._filter_study``), so nobody sees the brackets
    half built. A subclass, not a wrapper: Optuna gives the samplers bracket-filtered trials only when
    ``study.pruner`` is a ``HyperbandPruner``."""

    def __init__(self, *, min_resource: int, reduction_factor: int) -> None:
        super().__init__(min_resource=min_resource, reduction_factor=reduction_factor)
        self._lock = threading.RLock()

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        with self._lock:
            return super().prune(study, trial)

    def _get_bracket_id(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> int:
        with self._lock:
            return super()._get_bracket_id(study, trial)


def make_pruner(spec: PrunerSpec) -> optuna.pruners.BasePruner:
    if spec.kind == "hyperband":
        return ThreadSafeHyperbandPruner(
            min_resource=spec.min_resource, reduction_factor=spec.reduction_factor
        )
    if spec.kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=spec.warmup_steps)
    return optuna.pruners.NopPruner()


def open_study(settings: TuneSettings) -> optuna.Study:
    """Create the study, or load it when one of that name exists (a rerun resumes it)."""
    spec: StudySpec = settings.study
    directions = [goal.direction for goal in spec.goals]
    study = optuna.create_study(
        storage=make_storage(spec.storage),
        study_name=spec.name,
        directions=directions,
        sampler=make_sampler(settings),
        pruner=make_pruner(settings.pruner),
        load_if_exists=True,
    )
    stored = [d.name.lower() for d in study.directions]
    if stored != directions:
        wanted = ", ".join(f"{g.metric}: {g.direction}" for g in spec.goals)
        raise TunepodError(
            f"study {spec.name!r} in {spec.storage} was created to {' and '.join(stored)} "
            f"({len(stored)} objective(s)), but the spec says {wanted}; fix: use another study name, "
            f"or declare {len(stored)} objective(s) with these directions: {', '.join(stored)}"
        )
    return study
