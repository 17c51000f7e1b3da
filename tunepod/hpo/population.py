"""What the tuner does for population-based training (the rule is ``tunepod.hpo.pbt``): count members,
continue an exploited member from a donor's checkpoint as a new trial, seed that trial's job dir, and
tag the lineage in MLflow.

Exactly once, whatever crashes: an exploited trial gets one continuation. The donor's checkpoint is
first copied into the exploited trial's own job dir (``pbt-seed-from-<donor>``, by its driver but
outside its fence; a copy made before a crash is used as it is), then, inside the fence, the
continuation is created under the study lock only if no trial continues the exploited one yet
(``PbtState.replaces``), and only then is the exploited trial told PRUNED, with the number of its
continuation in a user attribute. A rerun that
finds the exploited job's cancel marker does the same steps and finds each done. The continuation's
job dir gets the seed as its checkpoint before its first job, so its job resumes from the donor's step.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from tunepod.errors import TunepodError
from tunepod.hpo.pbt import ATTR_PBT, Pbt, PbtState, generation_of, member_of
from tunepod.hpo.trials import ATTR_JOB_DIR, StudyTrials, set_aside_stale
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_submission
from tunepod.locks import locked
from tunepod.runtime.checkpoints import CheckpointInfo, copy_newest_checkpoint, latest_checkpoint
from tunepod.spec.models import TuneSettings
from tunepod.tracking import tags

log = logging.getLogger(__name__)

ATTR_CONTINUED_IN = "tunepod_pbt_continued_in"
"""On an exploited trial: the number of the trial its member went on in."""


def make_pbt(settings: TuneSettings) -> Pbt | None:
    spec = settings.pbt
    if spec is None:
        return None
    return Pbt(
        population=spec.population,
        interval=spec.interval,
        quantile=spec.quantile,
        maximize=settings.study.primary.direction == "maximize",
        max_resource=spec.max_resource,
        factors=spec.perturb.factors,
        resample_probability=spec.perturb.resample_probability,
        explored=None if spec.perturb.params is None else frozenset(spec.perturb.params),
    )


@dataclass(frozen=True)
class Seed:
    """What an exploited member goes on from: the donor's trial, the copy of its checkpoint (None:
    there was none to copy) and the explored parameters."""

    donor: FrozenTrial
    copied: CheckpointInfo | None
    params: dict[str, Any]


@dataclass
class Population:
    """The members of one study's population, over its trials and job dirs."""

    pbt: Pbt
    trials: StudyTrials
    jobs_dir: Path
    job_dir: Callable[[FrozenTrial], Path]
    distributions: dict[str, BaseDistribution]
    seed: int | None

    def room(self, trials: Sequence[FrozenTrial]) -> int:
        """Members still to ask for."""
        return self.pbt.population - len(first_members(trials))

    def seed_job_dir(self, trial: FrozenTrial) -> None:
        """Before a continuation's first job: the donor's checkpoint copy becomes its checkpoint."""
        state = PbtState.of(trial)
        paths = JobPaths(self.job_dir(trial))
        if state is None or not state.seed or read_submission(paths) is not None:
            return
        if latest_checkpoint(paths.checkpoints) is None:
            copy_newest_checkpoint(Path(state.seed).parent, paths.checkpoints)

    def seed_from_a_donor(self, exploited: FrozenTrial, donors: Sequence[int]) -> Seed:
        """A copy of the newest checkpoint of one of ``donors`` (members, tried in a seeded random
        order) in ``exploited``'s job dir; with none to copy, of its own. Of a donor at the end of its
        run, its newest checkpoint that leaves training to do (``_end_of``); a donor with none is
        passed over. Made outside the trial's
        fence: copying a large checkpoint must not hold the lease lock (the heartbeat renews every
        lease of the process under those locks), and a second copy by a stale driver only finds the
        first (``copy_newest_checkpoint`` keeps one step per folder)."""
        rng = random.Random(f"pbt/{self.seed}/{exploited.number}")
        trials = self.trials.all()
        donor, copied = self._copy_from_a_donor(exploited, rng.sample(list(donors), len(donors)), trials)
        return Seed(donor, copied, self.pbt.explore(donor.params, self.distributions, rng))

    def continue_member(self, exploited: FrozenTrial, seed: Seed) -> int:
        """The trial that continues ``exploited``'s member from ``seed``, created once (under the
        study lock, unless one replaces ``exploited`` already). Called inside ``exploited``'s fence;
        taking the study lock there cannot deadlock: under the study lock, leases are only taken
        without waiting (and PBT has no paused trials for ASHA's promotions to fence)."""
        state = PbtState(
            member=member_of(exploited),
            generation=generation_of(exploited) + 1,
            parent=seed.donor.number,
            from_step=seed.copied.step if seed.copied is not None else -1,
            replaces=exploited.number,
            seed=str(seed.copied.path) if seed.copied is not None else "",
        )
        with locked(self.jobs_dir / ".study.lock"):
            existing = self.continuation_of(exploited.number)
            if existing is not None:
                return existing
            number = self.trials.add_running(seed.params, self.distributions, {ATTR_PBT: state.to_attr()})
            # Its job dir recorded as an ask records it (under the lock: nobody sees it without).
            job_dir = self.jobs_dir / f"trial-{number}"
            set_aside_stale(job_dir)
            self.trials.set_attr(number, ATTR_JOB_DIR, str(job_dir))
        log.info(
            "trial %d (member %d) exploited: goes on as trial %d from trial %d's checkpoint at step %d, %s",
            exploited.number,
            state.member,
            number,
            seed.donor.number,
            state.from_step,
            seed.params,
        )
        return number

    def _copy_from_a_donor(
        self, exploited: FrozenTrial, donors: Sequence[int], trials: Sequence[FrozenTrial]
    ) -> tuple[FrozenTrial, CheckpointInfo | None]:
        for member in donors:
            head = self.pbt.head(member, trials)
            copied = self._copy_newest(head, self.job_dir(exploited) / f"pbt-seed-from-{head.number}")
            if copied is not None:
                return head, copied
        own = self._copy_newest(exploited, self.job_dir(exploited) / f"pbt-seed-from-{exploited.number}")
        return exploited, own

    def _end_of(self, trial: FrozenTrial) -> int | None:
        """The step a continuation from ``trial`` must start below to have training left: a checkpoint
        at a run's end makes a continuation that ends COMPLETE at once, with parameters it never
        trained with, and the sampler would learn from a pairing that never happened. The run's end
        is ``max_resource``, or, without it, the last step of a trial that completed."""
        if self.pbt.max_resource is not None:
            return self.pbt.max_resource - 1
        if trial.state is TrialState.COMPLETE and trial.intermediate_values:
            return max(trial.intermediate_values)
        return None

    def _copy_newest(self, trial: FrozenTrial, into: Path) -> CheckpointInfo | None:
        """A copy of ``trial``'s newest checkpoint that leaves training to do (``_end_of``); of its own
        seed while its first job has saved none."""
        end = self._end_of(trial)
        copied = copy_newest_checkpoint(JobPaths(self.job_dir(trial)).checkpoints, into, before=end)
        state = PbtState.of(trial)
        if copied is None and state is not None and state.seed:
            copied = copy_newest_checkpoint(Path(state.seed).parent, into, before=end)
        return copied

    def continuation_of(self, number: int) -> int | None:
        for trial in self.trials.all():
            state = PbtState.of(trial)
            if state is not None and state.replaces == number:
                return trial.number
        return None

    def donors_after_crash(self, exploited: FrozenTrial) -> list[int]:
        """The donors of an exploit a crashed orchestrator decided but did not record: as judged at
        the newest boundary the trial reached where it ranked in the bottom."""
        trials = self.trials.all()
        member = member_of(exploited)
        units = max(exploited.intermediate_values, default=-1) + 1
        for k in range(units // self.pbt.interval, 0, -1):
            donors = self.pbt.donors_for(member, k * self.pbt.interval, trials)
            if donors:
                return donors
        return []


def first_members(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The first trial of each member: the only trials without a lineage (an enqueued trial still
    WAITING is not asked yet)."""
    return [t for t in trials if t.state is not TrialState.WAITING and PbtState.of(t) is None]


def check_members(trials: Sequence[FrozenTrial], pbt: Pbt, study_name: str) -> None:
    """Raise ``TunepodError`` when study ``study_name`` holds more first members than the population:
    it was run without PBT (or with a larger population), its trials would all count as members, no
    member would be asked, and PBT would do nothing without a word. Call it before the first ask."""
    found = first_members(trials)
    if len(found) <= pbt.population:
        return
    numbers = ", ".join(str(t.number) for t in found[:5]) + (", ..." if len(found) > 5 else "")
    raise TunepodError(
        f"study {study_name} holds {len(found)} trials that continue no PBT member (trials {numbers}), "
        f"more than pbt.population {pbt.population}: it was run without pbt or with a larger "
        "population, each of them would count as a member, and PBT would ask none and exploit nothing; "
        f"fix: give study.name a new name for this PBT study, or set pbt.population to {len(found)} or more"
    )


def lineage(trials: Mapping[int, FrozenTrial], root: int) -> list[FrozenTrial]:
    """Member ``root``'s trials by number, first to last: each exploited trial followed to the trial
    it went on in (``ATTR_CONTINUED_IN``)."""
    chain = [trials[root]]
    while (following := chain[-1].user_attrs.get(ATTR_CONTINUED_IN)) is not None:
        chain.append(trials[int(following)])
    return chain


def lineage_tags(trial: FrozenTrial) -> dict[str, str]:
    """The MLflow tags of a trial's place in its member's lineage (a study under PBT)."""
    found = {tags.PBT_MEMBER: str(member_of(trial)), tags.PBT_GENERATION: str(generation_of(trial))}
    state = PbtState.of(trial)
    if state is not None:
        found |= {
            tags.PBT_PARENT: str(state.parent),
            tags.PBT_FROM_STEP: str(state.from_step),
            tags.PBT_REPLACES: str(state.replaces),
        }
    continued_in = trial.user_attrs.get(ATTR_CONTINUED_IN)
    if continued_in is not None:
        found[tags.PBT_CONTINUED_IN] = str(continued_in)
    return found
