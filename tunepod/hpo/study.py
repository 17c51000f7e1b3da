"""Opening an Optuna study from the spec: storage, sampler, pruner and search space."""

from __future__ import annotations

import copy
import fcntl
import json
import logging
import os
import threading
from collections.abc import Container
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages.journal import BaseJournalBackend, JournalFileBackend, JournalStorage

# Optuna's journal backend takes any lock of this base; it is only importable from its module.
from optuna.storages.journal._file import BaseJournalFileLock
from optuna.trial import FrozenTrial, TrialState

from tunepod import world
from tunepod.errors import TunepodError
from tunepod.hpo.asha import PausedAsPruned
from tunepod.runtime.files import append_whole, disk_full_explained
from tunepod.spec.models import (
    CategoricalParam,
    FloatParam,
    PrunerSpec,
    SearchParam,
    StudySpec,
    TuneSettings,
    WarmStart,
)
from tunepod.stores import opening_store, redacted, schema_lock, sync_sqlalchemy_url

JOURNAL_SCHEME = "journal://"
log = logging.getLogger(__name__)


def distributions(space: dict[str, SearchParam]) -> dict[str, BaseDistribution]:
    """The Optuna distributions of a search space, so ``study.ask`` can sample all params at once."""
    return {name: _distribution(param) for name, param in space.items()}


def _distribution(param: SearchParam) -> BaseDistribution:
    if isinstance(param, FloatParam):
        return FloatDistribution(param.low, param.high, log=param.log, step=param.step)
    if isinstance(param, CategoricalParam):
        return CategoricalDistribution(param.choices)
    return IntDistribution(param.low, param.high, log=param.log, step=param.step)


def make_storage(uri: str, field: str = "study.storage") -> BaseStorage:
    """``journal://<file>`` (a journal file, safe on a shared filesystem), ``sqlite:///<file>``, or a
    database URL (``postgresql://user:password@host/db`` is opened through psycopg 3).

    A database that cannot be opened raises ``StoreError``, naming ``field`` (where the spec sets
    ``uri``) and quoting neither the URL nor its password."""
    if uri.startswith(JOURNAL_SCHEME):
        path = Path(uri[len(JOURNAL_SCHEME) :]).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return UnfinishedIndexedJournalStorage(WholeLinesJournalBackend(path))
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        # Trials report from several threads at once; wait for SQLite's lock instead of failing.
        return RDBStorage(uri, engine_kwargs={"connect_args": {"timeout": 30}})
    with opening_store("the study storage", field, uri), schema_lock(uri, "optuna"):
        # A pooled connection dropped by the server (a restart, an RDS failover) is replaced, not raised.
        return RDBStorage(sync_sqlalchemy_url(uri), engine_kwargs={"pool_pre_ping": True})


class UnfinishedIndexedJournalStorage(JournalStorage):
    """Optuna's journal storage, whose read of the unfinished trials costs the trials in flight, not
    the study's size.

    The journal holds every trial in memory and picks those of the states asked for by looking at each
    one; Optuna's ask reads the WAITING trials that way, and the tuner the RUNNING and WAITING ones at
    every ask and every look at its slots, so each ask cost a pass over the whole study. A finished
    trial never runs again: each study's unfinished trials are kept by id, added to as trials appear
    (by this process or by another one appending to the journal) and dropped as they finish. A read
    that asks for a finished state is Optuna's own.
    """

    def __init__(self, backend: BaseJournalBackend) -> None:
        super().__init__(backend)
        self._open: dict[int, _OpenTrials] = {}

    def __setstate__(self, state: dict[Any, Any]) -> None:
        super().__setstate__(state)
        self._open = {}  # the journal is replayed afresh, and its trials indexed again

    def get_all_trials(
        self, study_id: int, deepcopy: bool = True, states: Container[TrialState] | None = None
    ) -> list[FrozenTrial]:
        if states is None or any(state in states for state in TrialState if state.is_finished()):
            return super().get_all_trials(study_id, deepcopy, states)
        with self._thread_lock:
            self._sync_with_backend()
            trials = [trial for trial in self._unfinished(study_id) if trial.state in states]
        return copy.deepcopy(trials) if deepcopy else trials

    def _unfinished(self, study_id: int) -> list[FrozenTrial]:
        """The study's unfinished trials, by number (the replay's own objects: callers copy)."""
        replay = self._replay_result
        if study_id not in replay._studies:
            return replay.get_all_trials(study_id, None)  # raises Optuna's own KeyError
        ids = replay._study_id_to_trial_ids[study_id]
        index = self._open.setdefault(study_id, _OpenTrials())
        index.ids.update(ids[index.seen :])
        index.seen = len(ids)
        # Trial ids grow with creation, as numbers do within a study: sorted by id is by number.
        unfinished = [
            replay._trials[i] for i in sorted(index.ids) if not replay._trials[i].state.is_finished()
        ]
        index.ids = {trial._trial_id for trial in unfinished}
        return unfinished


class _OpenTrials:
    """One study's trials that were unfinished when last read, and how many of its trials were seen."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.seen = 0


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


def is_feasible(frozen: optuna.trial.FrozenTrial) -> bool | None:
    """Whether a finished trial met every constraint set on it; None when it has none."""
    constraints = frozen.constraints
    return None if not constraints else all(value <= 0 for value in constraints.values())


#: Random trials before the model is used, when the spec does not say: Optuna's own defaults (TPE's
#: is ``startup_trials``).
_STARTUP_TRIALS = {"gp": 10, "cmaes": 1}


def startup_trials(settings: TuneSettings) -> int:
    """Random trials before the sampler's model is used: the spec's ``n_startup_trials``, else for
    TPE as many as run at once, at least 2. The first ``num_parallel`` are asked before any trial has
    reported, so they are drawn blind whatever the model; every random trial after them is one the
    model could have placed. In the quality simulator (digits, 3 parameters, 2 at a time, ASHA, 100
    seeds) TPE reached the target in 0.60x random search's median time with 2, 0.76x with Optuna's 10
    (benchmarks/README.md, quality/). gp and cmaes keep Optuna's defaults."""
    spec = settings.sampler
    if spec.n_startup_trials is not None:
        return spec.n_startup_trials
    if spec.kind == "tpe":
        return max(2, settings.max_parallel)
    return _STARTUP_TRIALS.get(spec.kind, 0)


def make_sampler(settings: TuneSettings, *, seed: int | None = None) -> optuna.samplers.BaseSampler:
    """The study's sampler; ``seed`` (default: the spec's) seeds its random numbers. The samplers that
    use constraints (tpe, gp, nsga2) read those the tuner sets on each trial (``set_constraints``).
    Under ASHA it sees paused trials as pruned ones (``PausedAsPruned``)."""
    sampler = _sampler(settings, settings.seed if seed is None else seed)
    return PausedAsPruned(sampler) if settings.pruner.kind == "asha" else sampler


def _sampler(settings: TuneSettings, seed: int | None) -> optuna.samplers.BaseSampler:
    spec = settings.sampler
    startup = startup_trials(settings)
    if spec.kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if spec.kind == "gp":
        return optuna.samplers.GPSampler(
            seed=seed, n_startup_trials=startup, deterministic_objective=spec.deterministic_objective,
        )  # fmt: skip
    if spec.kind == "cmaes":
        return optuna.samplers.CmaEsSampler(
            seed=seed, n_startup_trials=startup, popsize=spec.popsize,
            use_separable_cma=spec.use_separable_cma, with_margin=spec.with_margin, lr_adapt=spec.lr_adapt,
            warn_independent_sampling=False,
        )  # fmt: skip
    if spec.kind == "qmc":
        # One orchestrator asks in order; a second on the same study may repeat points (Optuna warns).
        return optuna.samplers.QMCSampler(
            qmc_type=spec.qmc_type, scramble=spec.scramble, seed=seed, warn_asynchronous_seeding=False
        )
    if spec.kind == "nsga2":
        return optuna.samplers.NSGAIISampler(
            seed=seed, population_size=spec.population_size, crossover_prob=spec.crossover_prob,
            mutation_prob=spec.mutation_prob,
        )  # fmt: skip
    # Multivariate TPE with the constant liar, so trials in flight are not suggested twice.
    return optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=startup, multivariate=spec.multivariate, constant_liar=True,
    )  # fmt: skip


def reseed_for_next_trial(study: optuna.Study, settings: TuneSettings, num_trials: int) -> None:
    """With a seed, make the sampler of the next ask depend on the seed AND on how many trials the
    study holds: a rerun, or a second orchestrator on the study, then continues the sequence instead
    of suggesting the first trials' parameters again, and one orchestrator stays reproducible."""
    if settings.seed is not None:
        study.sampler = make_sampler(settings, seed=trial_seed(settings.seed, num_trials))


def trial_seed(seed: int, num_trials: int) -> int:
    """A sampler seed drawn from the pair (study seed, trials so far). Not ``seed + num_trials``:
    with that, seed s+1 drew at trial n what seed s drew at trial n+1, so studies with neighbouring
    seeds shared nearly all their suggestions."""
    return int(np.random.SeedSequence([seed, num_trials]).generate_state(1)[0])


class ThreadSafeHyperbandPruner(optuna.pruners.HyperbandPruner):
    """Optuna's Hyperband pruner, safe to ask from every trial's driver thread at once.

    It builds its brackets on first use; two threads doing that together double its budgets and then
    fail with "This line should be unreachable". One re-entrant lock covers ``prune`` and the bracket
    lookup Optuna's samplers also call (``optuna.pruners._filter_study``), so nobody sees the brackets
    half built. A subclass, not a wrapper: Optuna gives the samplers bracket-filtered trials only when
    ``study.pruner`` is a ``HyperbandPruner``."""

    def __init__(self, *, min_resource: int, max_resource: int | None, reduction_factor: int) -> None:
        super().__init__(
            min_resource=min_resource,
            max_resource="auto" if max_resource is None else max_resource,
            reduction_factor=reduction_factor,
        )
        self._lock = world.rlock()

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        with self._lock:
            return super().prune(study, trial)

    def _get_bracket_id(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> int:
        with self._lock:
            return super()._get_bracket_id(study, trial)


def make_pruner(spec: PrunerSpec) -> optuna.pruners.BasePruner:
    # asha: the tuner judges trials itself (tunepod.hpo.asha), since Optuna's pruners can only kill.
    if spec.kind == "hyperband":
        return ThreadSafeHyperbandPruner(
            min_resource=spec.min_resource,
            max_resource=spec.max_resource,
            reduction_factor=spec.reduction_factor,
        )
    if spec.kind == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=spec.min_resource, reduction_factor=spec.reduction_factor
        )
    if spec.kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=spec.warmup_steps)
    if spec.kind == "threshold":
        return optuna.pruners.ThresholdPruner(
            lower=spec.lower, upper=spec.upper, n_warmup_steps=spec.warmup_steps
        )
    if spec.kind == "wilcoxon":
        return optuna.pruners.WilcoxonPruner(p_threshold=spec.p_threshold, n_startup_steps=spec.warmup_steps)
    return optuna.pruners.NopPruner()


def open_study(settings: TuneSettings, storage: BaseStorage | None = None) -> optuna.Study:
    """Create the study, or load it when one of that name exists (a rerun resumes it); in
    ``storage`` when given, else in the spec's ``study.storage``."""
    spec: StudySpec = settings.study
    directions = [goal.direction for goal in spec.goals]
    study = optuna.create_study(
        storage=storage if storage is not None else make_storage(spec.storage),
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
            f"study {spec.name!r} in {redacted(spec.storage)} was created to {' and '.join(stored)} "
            f"({len(stored)} objective(s)), but the spec says {wanted}; fix: use another study name, "
            f"or declare {len(stored)} objective(s) with these directions: {', '.join(stored)}"
        )
    check_space_change(study, settings)
    return study


def check_space_change(study: optuna.Study, settings: TuneSettings) -> None:
    """A resumed study whose search space changed: a wider or narrower range, or another step, is
    carried over (Optuna's samplers take the earlier trials as they are; those outside the new range
    are named in the log); a change Optuna cannot mix in one study (other categorical choices, log
    scale switched, another type) is refused with the way to carry the trials over instead."""
    wanted = distributions(settings.space)
    earlier: dict[str, BaseDistribution] = {}
    outside: dict[str, int] = {}
    for trial in study.get_trials(deepcopy=False):
        for name, value in trial.params.items():
            if name not in wanted:
                continue
            earlier.setdefault(name, trial.distributions[name])
            if settings.space[name].misfit(value) is not None:
                outside[name] = outside.get(name, 0) + 1
    clashes = []
    for name, before in earlier.items():
        try:
            optuna.distributions.check_distribution_compatibility(before, wanted[name])
        except ValueError as exc:
            clashes.append(f"{name}: was {_shown(before)}, the spec says {_shown(wanted[name])} ({exc})")
    name = settings.study.name
    if clashes:
        raise TunepodError(
            f"study {name!r} in {redacted(settings.study.storage)} was searched over another space, which "
            f"Optuna cannot mix with the spec's in one study: {'; '.join(clashes)}. Fix: give the study a "
            f"new name and add warm_start: [{{study: {name}}}]: its best trials that fit the new space run "
            "first, and those that do not are named"
        )
    for param, count in sorted(outside.items()):
        log.warning(
            "study %s: %d earlier trial(s) have %s outside the space's new range; kept", name, count, param
        )


def _shown(distribution: BaseDistribution) -> str:
    if isinstance(distribution, CategoricalDistribution):
        return f"choices {list(distribution.choices)}"
    if isinstance(distribution, FloatDistribution | IntDistribution):
        kind = "float" if isinstance(distribution, FloatDistribution) else "int"
        scale = ", log" if distribution.log else ""
        return f"{kind} [{distribution.low}, {distribution.high}]{scale}"
    return repr(distribution)


def enqueue_first_trials(study: optuna.Study, settings: TuneSettings) -> list[str]:
    """Put the spec's ``enqueue`` configurations, then the best trials of each ``warm_start`` study,
    in the study's queue; the next asks take them in order. A configuration the study holds already
    (queued, running or finished: a rerun, a second orchestrator) is not queued again. Returns what
    was done, one line per source, for the log."""
    said = []
    queued = sum(_enqueue(study, params) for params in settings.enqueue)
    if settings.enqueue:
        said.append(
            f"enqueue: {queued} of {len(settings.enqueue)} configurations queued (the rest ran before)"
        )
    for source in settings.warm_start:
        fits, unfit = _warm_start_params(source, settings)
        queued = sum(_enqueue(study, params) for params in fits)
        line = f"warm start from {source.study}: {queued} of its best {len(fits) + len(unfit)} queued"
        said.append(line + (f"; not carried: {'; '.join(unfit)}" if unfit else ""))
    return said


def _enqueue(study: optuna.Study, params: dict[str, Any]) -> bool:
    """Queue ``params`` unless the study holds them already; whether it was queued."""
    before = len(study.get_trials(deepcopy=False))
    study.enqueue_trial(params, skip_if_exists=True)
    return len(study.get_trials(deepcopy=False)) > before


def _warm_start_params(source: WarmStart, settings: TuneSettings) -> tuple[list[dict[str, Any]], list[str]]:
    """The parameters of ``source``'s ``top_k`` best completed trials that fit ``settings.space``
    (parameters the space does not have are dropped), and why each of the others does not fit."""
    storage = source.storage or settings.study.storage
    field = "warm_start[].storage" if source.storage else "study.storage"
    try:
        earlier = optuna.load_study(study_name=source.study, storage=make_storage(storage, field))
    except KeyError:
        raise TunepodError(
            f"warm_start: no study {source.study!r} in {redacted(storage)}; fix: name a study that exists "
            "there (optuna studies list), or set warm_start[].storage to where it is"
        ) from None
    completed = earlier.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(earlier.directions) > 1:
        best = earlier.best_trials
    else:
        sign = -1.0 if earlier.direction is optuna.study.StudyDirection.MAXIMIZE else 1.0
        best = sorted(completed, key=lambda t: (sign * float(t.value or 0.0), t.number))
    fits, unfit = [], []
    for trial in best[: source.top_k]:
        kept = {name: value for name, value in trial.params.items() if name in settings.space}
        misfits = [why for name, value in kept.items() if (why := settings.space[name].misfit(value))]
        if misfits:
            unfit.append(f"trial {trial.number} ({', '.join(misfits)})")
        else:
            fits.append(kept)
    return fits, unfit
