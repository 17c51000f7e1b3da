"""Opening an Optuna study from the spec: storage, sampler, pruner and search space."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.storages import BaseStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock, JournalStorage

from tunepod.errors import TunepodError
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
        # The open()-based lock works on filesystems without symlink support (some network mounts);
        # the journal is written from one orchestrator, so its cost does not matter.
        lock = JournalFileOpenLock(str(path))
        return JournalStorage(JournalFileBackend(str(path), lock_obj=lock))
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).expanduser().parent.mkdir(parents=True, exist_ok=True)
        # Trials report from several threads at once; wait for SQLite's lock instead of failing.
        return RDBStorage(uri, engine_kwargs={"connect_args": {"timeout": 30}})
    return RDBStorage(uri)


def make_sampler(settings: TuneSettings) -> optuna.samplers.BaseSampler:
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    # Multivariate TPE with the constant liar, so trials in flight are not suggested twice.
    return optuna.samplers.TPESampler(seed=settings.seed, multivariate=True, constant_liar=True)


def make_pruner(spec: PrunerSpec) -> optuna.pruners.BasePruner:
    if spec.kind == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=spec.min_resource, reduction_factor=spec.reduction_factor
        )
    if spec.kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=spec.warmup_steps)
    return optuna.pruners.NopPruner()


def open_study(settings: TuneSettings) -> optuna.Study:
    """Create the study, or load it when one of that name exists (a rerun resumes it)."""
    spec: StudySpec = settings.study
    study = optuna.create_study(
        storage=make_storage(spec.storage),
        study_name=spec.name,
        direction=spec.direction,
        sampler=make_sampler(settings),
        pruner=make_pruner(settings.pruner),
        load_if_exists=True,
    )
    stored = study.direction.name.lower()
    if stored != spec.direction:
        raise TunepodError(
            f"study {spec.name!r} in {spec.storage} was created to {stored}, but the spec says "
            f"{spec.direction}; fix: use another study name, or set direction: {stored}"
        )
    return study
