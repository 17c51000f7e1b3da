"""ASHA with pause and promote as a search policy (the rule is ``tunepod.hpo.asha``).

A job is stopped (``paused``) at a rung it reaches outside the top; its trial is *parked*: RUNNING
in Optuna with its reports, its pause state (``AshaState``) in the user attribute ``tunepod_asha``,
and no job. A free slot resumes first the parked trials the rule promotes now, then asks new trials;
once nothing is left to ask, a slot that would idle resumes the best parked trial (marked as resumed
for an idle slot), and once nothing but such resumptions runs and a trial has completed, the parked
trials the rule never promoted end PRUNED at the rung they reached. A promoted trial's job resumes
the attempt it was paused in, and its promotions are attempts that do not count as restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from optuna.trial import FrozenTrial, TrialState

from tunepod.hpo.asha import ATTR_ASHA, Asha, AshaState, RungJudge, is_paused
from tunepod.hpo.policies.contract import (
    Attempts,
    Ending,
    JobJudge,
    Plan,
    PolicyContext,
    RecordStop,
    SearchPolicy,
    SlotView,
    Told,
)
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_submission
from tunepod.spec.models import TuneSettings
from tunepod.tracking import tags

log = logging.getLogger(__name__)

PAUSED = "paused"
_BY_RULE = "rule"
_FOR_AN_IDLE_SLOT = "idle"


def make_asha(settings: TuneSettings) -> Asha | None:
    """The study's ASHA rule, when its pruner is ``asha``."""
    pruner = settings.pruner
    if pruner.kind != "asha":
        return None
    assert pruner.max_resource is not None, "validated: asha needs max_resource"
    return Asha(
        min_resource=pruner.min_resource,
        reduction_factor=pruner.reduction_factor,
        max_resource=pruner.max_resource,
        maximize=settings.study.primary.direction == "maximize",
        rank_by=pruner.rank_by,
    )


class AshaPolicy(SearchPolicy):
    """Pause at rungs, promote over checkpoints."""

    name = "asha"
    # A job that failed as it reached a rung it is paused at waits there, resumed from its
    # checkpoints if promoted: restarted, it would train past the rung.
    stops_kept_at_the_end = frozenset({PAUSED})

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        asha = make_asha(ctx.settings)
        assert asha is not None, "made for pruner kind asha"
        self.asha = asha
        self._resumes: dict[int, str] = {}
        """Why each trial of the last plan resumes (the rule, or a slot that would idle)."""

    # ------------------------------------------------------------------------------ a running job

    def judge(self, trial: FrozenTrial) -> _PauseAtRungs:
        return _PauseAtRungs(RungJudge.for_job(self.asha, trial.number, AshaState.of(trial)))

    def stopped(self, trial: FrozenTrial, judge: JobJudge | None, reason: str) -> RecordStop:
        if reason != PAUSED:
            return lambda: Ending.PRUNED
        decided = judge.paused_rung if isinstance(judge, _PauseAtRungs) else None
        return lambda: self._park(trial.number, decided)

    def _park(self, number: int, decided: int | None) -> Ending:
        """Record the pause of trial ``number``'s job: its rung (``decided``; None when a crashed
        orchestrator decided it, re-derived then) and the attempt a promotion resumes."""
        frozen = self.trials.frozen(number)
        before = AshaState.of(frozen)
        rung = decided
        if rung is None:
            rung = self.asha.pause_rung(frozen, before, self.trials.all())
        if rung is None:
            rung = self.asha.highest_rung(frozen) or 0
        record = read_submission(JobPaths(self.ctx.job_dir(frozen)))
        attempt = record.attempt if record is not None else 1
        self.trials.set_attr(number, ATTR_ASHA, AshaState.pause(before, rung, attempt).to_attr())
        log.info("trial %d paused at rung %d (%d units)", number, rung, self.asha.rungs[rung])
        return Ending.PARKED

    # ------------------------------------------------------------------------------ slots

    def is_parked(self, trial: FrozenTrial) -> bool:
        return is_paused(trial)

    def plan(self, view: SlotView) -> Plan:
        promoted = self.asha.promotable(view.trials)[: max(view.capacity, 0)]
        capacity = view.capacity - len(promoted)
        ask = max(0, min(view.room, capacity))
        capacity -= ask
        self._resumes = dict.fromkeys(promoted, _BY_RULE)
        if view.room - ask > 0:
            return Plan(resume=tuple(promoted), ask=ask)
        # Nothing left to ask. While the study's own work runs (not only trials resumed for slots
        # that would idle, by any orchestrator: those would keep each other going until every trial
        # had trained to the end), or before any trial has completed (at the top rungs too few trials
        # may ever meet for the rule to promote anyone), a slot that would idle resumes the best
        # parked trial; after that, the parked trials the rule never promoted end PRUNED.
        busy = bool(promoted or ask or _own_work(view))
        completed = any(t.state is TrialState.COMPLETE for t in view.trials)
        if busy or not completed:
            idle = [n for n in self.asha.by_merit(view.trials) if n not in self._resumes]
            idle = idle[: max(capacity, 0)]
            self._resumes |= dict.fromkeys(idle, _FOR_AN_IDLE_SLOT)
            return Plan(resume=(*promoted, *idle), ask=ask)
        return Plan(ask=ask, end=tuple(t.number for t in view.trials if is_paused(t)))

    def resume(self, number: int) -> str | None:
        state = AshaState.of(self.trials.frozen(number))
        if state is None or not state.paused:
            return None  # promoted meanwhile, by one that has let go already
        idle = self._resumes.get(number) == _FOR_AN_IDLE_SLOT
        self.trials.set_attr(number, ATTR_ASHA, state.promoted(idle=idle).to_attr())
        why = " for a slot that would idle" if idle else ""
        return f"trial {number}: promoted from rung {state.rung}{why}, resuming from its checkpoint"

    # ------------------------------------------------------------------------------ a trial's job

    def attempts(self, trial: FrozenTrial) -> Attempts:
        """A promoted trial resumes the attempt it was paused in, and its promotions are attempts
        that do not count against ``max_restarts``."""
        state = AshaState.of(trial)
        if state is None or not state.promotions:
            return Attempts()
        return Attempts(extra=state.promotions, resume_attempt=state.attempt)

    def tags(self, trial: FrozenTrial) -> Mapping[str, str]:
        state = AshaState.of(trial)
        if state is None:
            return {}
        return {tags.PROMOTIONS: str(state.promotions), tags.PAUSED_AT_RUNG: str(state.rung)}


class _PauseAtRungs:
    """Pauses a job at a rung it has just reached outside the top. Each rung is judged once per
    judge; a restarted orchestrator's new judge judges the rungs the job reached again, from the one
    after its last promotion. Judged on the values Optuna holds: past step 1,000 it is told only some
    steps, and a rung's value is the first one told at or past it."""

    def __init__(self, rungs: RungJudge) -> None:
        self._rungs = rungs
        self.paused_rung: int | None = None
        """The rung the job was paused at, once it was."""

    def judge(self, told: Told) -> str | None:
        rung = self._rungs.judge(told.units, told.trials)
        if rung is None:
            return None
        self.paused_rung = rung
        return PAUSED


def _own_work(view: SlotView) -> bool:
    """Whether a trial in flight is the study's own work: any but one resumed for an idle slot."""
    by_number = {t.number: t for t in view.trials}
    return any(not _resumed_for_idle_slot(by_number[n]) for n in view.in_flight if n in by_number)


def _resumed_for_idle_slot(trial: FrozenTrial) -> bool:
    state = AshaState.of(trial)
    return state is not None and state.idle and not state.paused
