"""The one seam between tunepod and Optuna's storage internals.

ask/tell drivers need two things ``optuna.Study`` does not offer publicly: a trial by its number (to
report intermediate values and ask ``should_prune`` from any thread or process), and user attributes
set on a trial by number. Both go through ``study._storage`` and ``_trial_id`` here, and nowhere else.

Optuna holds the outcome of every trial; its storage is the source of truth. A storage that fails in
a way a retry can fix (a locked SQLite or journal file) is retried here with a short backoff.
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from tunepod import world
from tunepod.errors import is_transient

logger = logging.getLogger(__name__)

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
UNFINISHED = (TrialState.RUNNING, TrialState.WAITING)
ATTR_JOB_DIR = "tunepod_job_dir"
"""The trial's job dir, recorded when its ask finished (a RUNNING trial without it is half asked)."""
_RETRIES = 8
_FIRST_DELAY_S = 0.2
T = TypeVar("T")


@dataclass(frozen=True)
class Tally:
    """A study's trials counted: the unfinished ones as they are, the finished ones by state."""

    unfinished: tuple[FrozenTrial, ...]
    """RUNNING and WAITING trials (half-asked ones included), by number."""
    finished: Mapping[str, int]
    """Finished trials by state name (COMPLETE, PRUNED, FAIL)."""
    last_completed: float | None
    """When the last COMPLETE trial completed (epoch seconds); None before the first."""

    @property
    def num_trials(self) -> int:
        """Every trial of the study, whatever its state."""
        return len(self.unfinished) + sum(self.finished.values())

    def count(self, state: str) -> int:
        """Trials in ``state`` (a ``TrialState`` name)."""
        return self.finished.get(state, 0) + sum(t.state.name == state for t in self.unfinished)


class StudyTrials:
    """Trials of one study, by number. Thread safe as far as the Optuna storage is.

    ``tally`` counts the study without reading every trial: a finished trial cannot change, so each
    is read once when it is first seen finished and counted from then on; only the unfinished ones
    (at most the trials in flight and the parked ones) are read again. What runs at every ask and
    tell costs the same at trial 10,000 as at trial 10."""

    def __init__(self, study: optuna.Study) -> None:
        self.study = study
        # The world's: a simulated study's threads yield inside the storage, the lock held.
        self._tally_lock = world.lock()
        self._numbers_seen = 0
        self._open: set[int] = set()
        self._finished: Counter[str] = Counter()
        self._last_completed: float | None = None

    def all(self) -> list[FrozenTrial]:
        """Every trial: a read that grows with the study, for a study's start and end and for the
        policies whose rule ranks every trial (ASHA, PBT)."""
        return retried(lambda: self.study.get_trials(deepcopy=False))

    def unfinished(self) -> list[FrozenTrial]:
        """The RUNNING and WAITING trials, by number."""
        return retried(lambda: self.study.get_trials(deepcopy=False, states=UNFINISHED))

    def tally(self) -> Tally:
        """The study counted, reading only its unfinished trials and those that finished or appeared
        since the last tally (another orchestrator's included). A read that fails leaves the counts
        as they were, for the next tally to count again."""
        with self._tally_lock:
            unfinished = self.unfinished()
            still_open = {t.number for t in unfinished}
            appeared = range(self._numbers_seen, self._count_numbers())
            read = [self.frozen(n) for n in sorted((self._open | set(appeared)) - still_open)]
            for frozen in read:
                if frozen.state in FINISHED:
                    self._count_finished(frozen)
                else:  # created after the read of the unfinished ones (another orchestrator's ask)
                    still_open.add(frozen.number)
                    unfinished.append(frozen)
            self._open = still_open
            self._numbers_seen = max(self._numbers_seen, appeared.stop)
            return Tally(tuple(unfinished), dict(self._finished), self._last_completed)

    def _count_numbers(self) -> int:
        """How many trials the study holds: trial numbers are 0, 1, ... with no gap, so the first
        number past those already seen that has no trial is the count (one lookup per new trial)."""
        number = self._numbers_seen
        while self._exists(number):
            number += 1
        return number

    def _exists(self, number: int) -> bool:
        try:
            self._trial_id(number)
        except KeyError:
            return False
        return True

    def _count_finished(self, frozen: FrozenTrial) -> None:
        self._finished[frozen.state.name] += 1
        if frozen.state is TrialState.COMPLETE and frozen.datetime_complete is not None:
            completed = frozen.datetime_complete.timestamp()
            self._last_completed = max(self._last_completed or completed, completed)

    def frozen(self, number: int) -> FrozenTrial:
        storage = self.study._storage
        return retried(lambda: storage.get_trial(self._trial_id(number)))

    def live(self, number: int) -> optuna.trial.Trial:
        """The trial as ``optuna.trial.Trial`` (for ``report`` and ``should_prune``)."""
        return optuna.trial.Trial(self.study, self._trial_id(number))

    def set_attr(self, number: int, key: str, value: object) -> None:
        """Set a user attribute of a RUNNING trial; a finished trial's are never rewritten."""
        frozen = self.frozen(number)
        if frozen.state in FINISHED:
            logger.debug("trial %d is finished; user attr %s stays as it is", number, key)
            return
        storage = self.study._storage
        retried(lambda: storage.set_trial_user_attr(frozen._trial_id, key, value))

    def set_constraints(self, number: int, violations: dict[str, float]) -> None:
        """Each constraint's violation (at most 0 where it holds) on a RUNNING trial, through Optuna's
        constraint API, before it is told: samplers that use constraints read them then."""
        if self.frozen(number).state in FINISHED:
            return
        live = self.live(number)
        for key, value in violations.items():
            retried(lambda key=key, value=value: live.set_constraint(key, value))  # type: ignore[misc]

    def complete_params(self, number: int, distributions: Mapping[str, BaseDistribution]) -> None:
        """Suggest the parameters of ``distributions`` that RUNNING trial ``number`` lacks, as
        ``study.ask(distributions)`` would have (sampler, fixed params of an enqueued trial, relative
        sampling): finishes an ask that was interrupted after Optuna created the trial."""
        live = self.live(number)
        for name, distribution in distributions.items():
            retried(lambda name=name, distribution=distribution: live._suggest(name, distribution))  # type: ignore[misc]

    def add_running(
        self,
        params: Mapping[str, object],
        distributions: Mapping[str, BaseDistribution],
        attrs: Mapping[str, object],
    ) -> int:
        """A new RUNNING trial with fixed ``params`` and user ``attrs`` (no sampler asked); its number.
        Not retried: a retry after a create that succeeded unseen would leave a second trial."""
        template = create_trial(
            state=TrialState.RUNNING,
            params=dict(params),
            distributions=dict(distributions),
            user_attrs=dict(attrs),
        )
        storage = self.study._storage
        trial_id = storage.create_new_trial(self.study._study_id, template_trial=template)
        return int(retried(lambda: storage.get_trial_number_from_id(trial_id)))

    def tell(self, number: int, state: TrialState, value: float | Sequence[float] | None = None) -> None:
        """Record a trial's outcome once (a finished trial keeps the outcome it has); ``value`` is a
        list for a multi-objective study."""
        retried(lambda: self.study.tell(number, value, state=state, skip_if_finished=True))

    def _trial_id(self, number: int) -> int:
        storage = self.study._storage
        study_id = self.study._study_id
        return retried(lambda: storage.get_trial_id_from_study_id_trial_number(study_id, number))


def retried(call: Callable[[], T]) -> T:
    """``call()``, retried with backoff while it fails in a way a retry can fix (``is_transient``)."""
    delay = _FIRST_DELAY_S
    for attempt in range(_RETRIES):
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc) or attempt == _RETRIES - 1:
                raise
            logger.warning("study storage busy (%s); retrying in %.1fs", exc, delay)
            world.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def set_aside_stale(job_dir: Path) -> None:
    """A new trial must not resume from checkpoints of a deleted study that had the same name."""
    if job_dir.exists() and any(job_dir.iterdir()):
        stale = job_dir.with_name(f"{job_dir.name}.stale-{int(world.time())}")
        logger.warning("moving leftover %s (from an earlier study of the same name) to %s", job_dir, stale)
        shutil.move(job_dir, stale)
