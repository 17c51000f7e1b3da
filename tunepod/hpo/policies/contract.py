"""The contract between the tuning loop (``tunepod.hpo.tuner``) and a search policy.

The tuner claims, leases, asks, drives, tells and mirrors trials; a policy decides which jobs stop
early and what a free slot is given. It is Ray Tune's ``TrialScheduler`` (hear results, answer
continue / pause / stop, choose the next trial to run) and Optuna's ``BasePruner`` (``should_prune``)
made one, for trials that are jobs on a cluster and may outlive the orchestrator that started them:

- **A running job is judged** each time Optuna holds a new value of it: ``judge(trial)`` makes a
  ``JobJudge`` per job, whose ``judge`` answers None (go on) or a reason to stop (the job's cancel
  marker records it, the launch layer stops the job and hands the reason back).
- **A stop is recorded** once the job has ended: ``stopped`` does the slow part of it outside the
  trial's lease fence (a checkpoint copy) and returns a call that records it inside the fence. The
  trial then ends PRUNED, or is *parked*: it stays RUNNING in Optuna, with no job, for the policy to
  resume later (``is_parked``).
- **A free slot is filled** as ``plan`` says, under the study lock: parked trials to resume (each
  recorded by ``resume`` inside its fence before its new job starts), how many new trials to ask, and
  parked trials to end PRUNED.

Policies judge on what Optuna holds (the values it was told, the policy's own user attribute on each
trial), never on what one orchestrator remembers: every orchestrator on a study reads the same, and a
restarted one decides as its predecessor did. Each policy keeps its state in one user attribute per
trial, written whole. The tuner never names a policy; it only calls what is below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Protocol

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from tunepod.hpo.trials import StudyTrials
from tunepod.spec.models import TuneSettings


@dataclass(frozen=True)
class PolicyContext:
    """What a policy is made from: the study's settings and trials, and where their jobs live."""

    settings: TuneSettings
    trials: StudyTrials
    jobs_dir: Path
    job_dir: Callable[[FrozenTrial], Path]
    distributions: dict[str, BaseDistribution]
    job_writes_job_dir: bool
    """The launcher's jobs write their job dir where this machine reads it (checkpoints included)."""
    launcher: str
    """The launcher's kind, for messages."""


@dataclass(frozen=True)
class Told:
    """What a judge sees of a running job: the newest step Optuna holds a value of, the trial as
    ``optuna.trial.Trial`` (for Optuna's pruners) and the study's trials, both read only when asked
    (most reports decide nothing)."""

    number: int
    step: int
    live: Callable[[], optuna.trial.Trial]
    trials: Callable[[], Sequence[FrozenTrial]]

    @property
    def units(self) -> int:
        """Units of training the job has been judged on: a reported step + 1 (a job reporting epochs
        0, 1, ... has trained ``r`` units at step ``r - 1``)."""
        return self.step + 1


class JobJudge(Protocol):
    """Judges one running job of a trial, each time Optuna is told a new value of it, and once at the
    first reports of a driver that took over a trial Optuna holds values of (the driver before it may
    have died between telling a value and judging it), so a judge must take a value judged before."""

    def judge(self, told: Told) -> str | None:
        """None: go on; else the reason to stop the job (a word: its cancel marker records it)."""
        ...


class Ending(Enum):
    """What a stop made of its trial."""

    PRUNED = "PRUNED"
    """Finished: the tuner tells Optuna PRUNED and closes its MLflow run."""
    PARKED = "PARKED"
    """RUNNING in Optuna with no job, until the policy resumes or ends it."""


RecordStop = Callable[[], Ending]
"""Records a stop inside the trial's lease fence; says what it made of the trial."""


@dataclass(frozen=True)
class StudyState:
    """The study as it stands when slots are filled (under the study lock), half-asked trials left
    out (the next ask finishes them). What every policy needs is read at the cost of the trials in
    flight: the unfinished trials and how many finished; every trial only when a policy's rule asks
    for them (``trials``), once per look."""

    unfinished: Sequence[FrozenTrial]
    """The RUNNING and WAITING trials, by number."""
    num_finished: int
    """Trials finished (COMPLETE, PRUNED, FAIL)."""
    read_trials: Callable[[], Sequence[FrozenTrial]]
    """Every trial, read from the study (what ``trials`` holds)."""

    @cached_property
    def trials(self) -> Sequence[FrozenTrial]:
        """Every trial: a read that grows with the study, for a rule that ranks them all (ASHA)."""
        return self.read_trials()

    @property
    def num_running(self) -> int:
        """Trials RUNNING in Optuna (parked ones included)."""
        return sum(t.state is TrialState.RUNNING for t in self.unfinished)


@dataclass(frozen=True)
class SlotView:
    """The study as it stands when slots are filled (under the study lock)."""

    study: StudyState
    in_flight: frozenset[int]
    """Trials whose jobs take a slot, whoever drives them."""
    capacity: int
    """Free slots."""
    room: int
    """Trials still to ask for (``room``)."""

    @property
    def trials(self) -> Sequence[FrozenTrial]:
        """Every trial, half-asked ones left out (read when first asked for)."""
        return self.study.trials


@dataclass(frozen=True)
class Plan:
    """How to fill free slots: the tuner asks, then resumes, then ends, in that order (every trial
    of ``num_trials`` is asked for before a slot goes to a trial only because it would idle)."""

    resume: tuple[int, ...] = ()
    """Parked trials to resume, in order (the tuner skips one it cannot lease)."""
    ask: int = 0
    """New trials to ask for."""
    end: tuple[int, ...] = ()
    """Parked trials to end PRUNED."""


@dataclass(frozen=True)
class Attempts:
    """How a trial's job is driven: ``extra`` attempts beyond ``max_restarts`` (resumptions are no
    restarts after a failure), and the attempt whose stopped job is to be resumed (None: none)."""

    extra: int = 0
    resume_attempt: int | None = None


class SearchPolicy:
    """A policy that stops nothing: every trial trains to its end, ``num_trials`` of them. Policies
    override what they decide; each method says when the tuner calls it."""

    name = "none"
    stops_kept_at_the_end: frozenset[str] = frozenset()
    """The stops (``judge``'s reasons) that still apply when the reports that decided them were the
    job's last, fed as it failed: the failed job is then stopped for it, not restarted. A stop that
    ends the trial (a prune) is not kept: the trial's outcome is its job's, restarted as a failure."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.trials = ctx.trials

    # ------------------------------------------------------------------------------ a running job

    def judge(self, trial: FrozenTrial) -> JobJudge | None:
        """A judge for the job about to run (or re-attached to) for ``trial``; None: never stop it."""
        return None

    def stopped(self, trial: FrozenTrial, judge: JobJudge | None, reason: str) -> RecordStop:
        """A job this policy stopped (``reason``) has ended. Outside the fence: prepare what the stop
        needs (``judge`` is the one that decided it; None when a crashed orchestrator's did, which
        the policy then re-derives). The returned call records the stop, inside the fence."""
        return lambda: Ending.PRUNED

    # ------------------------------------------------------------------------------ slots

    def is_parked(self, trial: FrozenTrial) -> bool:
        """RUNNING in Optuna with no job, waiting for this policy: never claimed, never in flight."""
        return False

    def room(self, study: StudyState) -> int:
        """Trials still to ask for: ``num_trials`` less those finished and those running."""
        return self.settings.num_trials - study.num_finished - study.num_running

    def plan(self, view: SlotView) -> Plan:
        """Under the study lock: what fills ``view.capacity`` free slots."""
        return Plan(ask=max(0, min(view.room, view.capacity)))

    def resume(self, number: int) -> str | None:
        """Inside parked trial ``number``'s fence, before its new job: record that it resumes. Returns
        a line for the log, or None when it is parked no more (resumed or ended meanwhile)."""
        return None

    # ------------------------------------------------------------------------------ a trial's job

    def attempts(self, trial: FrozenTrial) -> Attempts:
        return Attempts()

    def before_job(self, trial: FrozenTrial) -> None:
        """Before ``trial``'s job is started or re-attached to (a continuation's job dir is seeded)."""

    def owns(self, trial: FrozenTrial) -> bool:
        """A trial this policy created itself, whole (never one an interrupted ask left half asked)."""
        return False

    def first_step(self, trial: FrozenTrial) -> int | None:
        """The step ``trial`` starts training after, when it starts from another's checkpoint."""
        return None

    def tags(self, trial: FrozenTrial) -> Mapping[str, str]:
        """MLflow tags of ``trial``'s run (its place in the policy)."""
        return {}
