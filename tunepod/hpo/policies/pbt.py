"""Population-based training as a search policy (the rule is ``tunepod.hpo.pbt``; what is done to
trials and job dirs, ``tunepod.hpo.population``).

A job is stopped (``exploited``) at a boundary where its member ranks in the bottom; its trial ends
PRUNED, and its member goes on in a new trial from a copy of a donor's checkpoint, with the donor's
parameters explored. The copy is made outside the trial's fence (it may be large), the continuation
inside it, once. Continuations are made, never asked: only each member's first trial is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from optuna.trial import FrozenTrial

from tunepod.errors import TunepodError
from tunepod.hpo.pbt import ATTR_PBT, BoundaryJudge, PbtState
from tunepod.hpo.policies.contract import (
    Ending,
    JobJudge,
    PolicyContext,
    RecordStop,
    SearchPolicy,
    StudyState,
    Told,
)
from tunepod.hpo.population import (
    ATTR_CONTINUED_IN,
    Population,
    Seed,
    check_members,
    lineage_tags,
    make_pbt,
)

EXPLOITED = "exploited"


class PbtPolicy(SearchPolicy):
    """Exploit the bottom of the population at each boundary, explore the donor's parameters."""

    name = "pbt"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        pbt = make_pbt(ctx.settings)
        assert pbt is not None, "made for a spec with pbt"
        if not ctx.job_writes_job_dir:
            raise TunepodError(
                f"study {ctx.settings.study.name}: pbt copies checkpoints between members' job dirs, and the "
                f"{ctx.launcher} launcher's jobs write theirs where this machine cannot read them; fix: "
                "mount FSx read-write on the launcher (fsx with access_mode rw), or remove pbt"
            )
        self.population = Population(
            pbt, ctx.trials, ctx.jobs_dir, ctx.job_dir, ctx.distributions, ctx.settings.seed
        )
        check_members(ctx.trials.all(), pbt, ctx.settings.study.name)

    # ------------------------------------------------------------------------------ a running job

    def judge(self, trial: FrozenTrial) -> _ExploitAtBoundaries:
        return _ExploitAtBoundaries(BoundaryJudge.for_job(self.population.pbt, trial))

    def stopped(self, trial: FrozenTrial, judge: JobJudge | None, reason: str) -> RecordStop:
        if reason != EXPLOITED:
            return lambda: Ending.PRUNED
        decided = judge.donors if isinstance(judge, _ExploitAtBoundaries) else []
        seed = self._seed_for(trial.number, decided)
        return lambda: self._continue(trial.number, seed)

    def _seed_for(self, number: int, decided: Sequence[int]) -> Seed | None:
        """Outside the fence: the donor's checkpoint copy the exploited member goes on from; None
        when a continuation exists already (made before a crash)."""
        if self.population.continuation_of(number) is not None:
            return None
        frozen = self.trials.frozen(number)
        donors = list(decided) or self.population.donors_after_crash(frozen)
        return self.population.seed_from_a_donor(frozen, donors)

    def _continue(self, number: int, seed: Seed | None) -> Ending:
        """Inside the fence: the member's continuation (created once), recorded on the trial."""
        continuation = self.population.continuation_of(number)
        if continuation is None:
            assert seed is not None, "a seed is made whenever no continuation exists"
            continuation = self.population.continue_member(self.trials.frozen(number), seed)
        self.trials.set_attr(number, ATTR_CONTINUED_IN, continuation)
        return Ending.PRUNED

    # ------------------------------------------------------------------------------ slots

    def room(self, study: StudyState) -> int:
        """Members still to ask for: continuations are made by exploits, never asked."""
        return self.population.room(study.trials)

    # ------------------------------------------------------------------------------ a trial's job

    def before_job(self, trial: FrozenTrial) -> None:
        self.population.seed_job_dir(trial)

    def owns(self, trial: FrozenTrial) -> bool:
        return ATTR_PBT in trial.user_attrs

    def first_step(self, trial: FrozenTrial) -> int | None:
        state = PbtState.of(trial)
        return state.from_step if state is not None and state.from_step >= 0 else None

    def tags(self, trial: FrozenTrial) -> Mapping[str, str]:
        return lineage_tags(trial)


class _ExploitAtBoundaries:
    """Exploits a job at a boundary it has reached in the bottom of the population, judged on the
    values Optuna holds."""

    def __init__(self, boundaries: BoundaryJudge) -> None:
        self._boundaries = boundaries
        self.donors: list[int] = []
        """The members to copy from, best first, once the job was exploited."""

    def judge(self, told: Told) -> str | None:
        self.donors = self._boundaries.judge(told.units, told.trials)
        return EXPLOITED if self.donors else None
