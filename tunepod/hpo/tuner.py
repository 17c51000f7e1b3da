"""The tuning loop: keep ``num_parallel`` training jobs in flight, prune the bad ones, tell Optuna.

Trial identity is stable: study + trial number -> one job dir (``<jobs>/<study>/trial-<n>``, with its
checkpoints), one MLflow child run. Optuna holds each trial's outcome; the job dir holds the truth
about its job (``tunepod.launch.drive``); MLflow mirrors both, through the outbox, and never decides
anything.

Several orchestrators may run one study at once (``tunepod run`` twice, a Prefect retry of the tune
step while its first attempt's trials still run). Each trial is driven by whoever holds its job dir's
lease (``tunepod.launch.lease``); the others follow it until it finishes or its lease expires. Asking
for new trials happens under a study-wide file lock, so the study ends with exactly ``num_trials``
finished trials however many orchestrators share it. A trial that an interrupted ask left behind
(created, but its parameters or its job dir not yet recorded) is finished being asked by the next
ask, never trained half-asked. The outcome is told to Optuna inside the lease's fence: a driver whose
lease was taken over tells nothing.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from tunepod import watch, world
from tunepod.errors import JobError, TunepodError
from tunepod.hpo.endings import ending_line, ending_of, why_ended
from tunepod.hpo.num_parallel import resolve_num_parallel
from tunepod.hpo.policies import PolicyContext, make_policy
from tunepod.hpo.policies.contract import Ending, JobJudge, Plan, SlotView, StudyState, Told
from tunepod.hpo.study import (
    distributions,
    enqueue_first_trials,
    is_feasible,
    open_study,
    reseed_for_next_trial,
)
from tunepod.hpo.trials import ATTR_JOB_DIR, FINISHED, StudyTrials, Tally, retried, set_aside_stale
from tunepod.launch.base import JobHandle, JobSpec, Launcher
from tunepod.launch.contract import contract_env
from tunepod.launch.drive import DriveResult, DriveSettings, JobDriver, Outcome
from tunepod.launch.lease import Lease, LeaseLost, Leases
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import CancelReason, read_submission
from tunepod.launch.watchdog import Limits
from tunepod.locks import locked
from tunepod.metrics import default_metrics
from tunepod.outputs import Dataset, Goal, TrialOutcome, TrialRecord, TrialSet
from tunepod.runtime import Parallelism, Report
from tunepod.runtime.checkpoints import saved_checkpoints
from tunepod.spec.models import LOCAL_MLFLOW_UI, TuneSettings
from tunepod.spec.parallelism import job_layout, script_params
from tunepod.tracking import RunTracker, tags
from tunepod.tracking.mirror import Final, ModelPlan, RunMirror, RunPlan, read_mirror_state
from tunepod.tracking.mlflow_tracker import Point, RunStatus
from tunepod.tracking.outbox import TrackingOutbox
from tunepod.tracking.reserve import RunReserve

log = logging.getLogger(__name__)

# Keys of the per-trial user attrs; they are the contract between runs of the orchestrator.
ATTR_JOB_ID = "tunepod_job_id"
ATTR_RUN_ID = "tunepod_mlflow_run_id"
ATTR_ERROR = "tunepod_error"
# The last step a multi-objective trial reported (Optuna keeps intermediate values for one objective only).
ATTR_LAST_STEP = "tunepod_last_step"

OUTCOME: dict[TrialState, TrialOutcome] = {
    TrialState.COMPLETE: "COMPLETE",
    TrialState.PRUNED: "PRUNED",
    TrialState.FAIL: "FAIL",
}
RUN_STATUS: dict[TrialState, RunStatus] = {
    TrialState.COMPLETE: "FINISHED",
    TrialState.PRUNED: "KILLED",
    TrialState.FAIL: "FAILED",
}
# How long a trial's job waits for its MLflow run to exist (MLFLOW_RUN_ID in its environment) before
# it starts without one: a slow or absent tracking server must not hold training back.
RUN_ID_WAIT_S = 5.0
# How often the loop looks at trials that other orchestrators drive.
FOLLOW_POLL_S = 1.0
# Optuna is told every step below 10**3, then steps of this many significant digits (next_step_to_tell).
_DENSE_STEPS_DIGITS = 3

# Runs one trial to its end, somewhere (a thread, a Prefect task run), and hands back a future.
TrialSubmitter = Callable[["Tuner", int], "Future[TrialRecord]"]


@dataclass(frozen=True)
class TuneContext:
    """Everything a tune step needs from the pipeline around it."""

    step: str
    settings: TuneSettings
    launcher: Launcher
    dataset: Dataset
    jobs_dir: Path
    tracker: RunTracker
    outbox: TrackingOutbox
    parent_run_id: str
    pipeline: str
    flush_timeout_s: float = 600.0
    mlflow_ui_url: str = LOCAL_MLFLOW_UI
    storage: BaseStorage | None = None
    """The Optuna storage to use instead of opening the spec's ``study.storage`` (a simulation's)."""
    open_run_reserve: Callable[[int], RunReserve] | None = None
    """Opens the reserve of MLflow runs made ahead of the trials (``tunepod.tracking.reserve``), given
    how many trials run at once; None: each trial's run is created as the trial starts."""


@dataclass(frozen=True)
class TrialLinks:
    """How a trial shows in an orchestrator's UI (Prefect's, for the flow): tags for its MLflow run
    (the UI's id and URL of the trial), and a call with the MLflow run id once that run exists (to
    link it from the UI). A failing call is logged, never the trial's failure."""

    tags: Mapping[str, str] = field(default_factory=dict)
    on_run: Callable[[str], None] | None = None


@dataclass(frozen=True)
class JobFacts:
    """What a trial's record takes from its job dir."""

    job_dir: Path
    run_id: str | None
    model_id: str | None
    """The checkpoint model logged in the run, once its final record is written."""
    job_id: str | None


class EndedHere:
    """The job facts of the trials this orchestrator ended, so that the study's end reads no file per
    trial (at 10,000 trials, 20,000 small reads made up seconds of the step's tail). A finished
    trial's job dir, job and run do not change; its logged model is known once its mirror has written
    the final record. Until then the trial is kept with its mirror, and with the facts alone after:
    only the trials whose final records wait in the outbox keep a mirror (and what it holds: its
    run's plan, its unlogged reports). Thread safe."""

    def __init__(self) -> None:
        self._facts: dict[int, JobFacts] = {}
        self._waiting: dict[int, tuple[Path, str | None, RunMirror]] = {}
        self._lock = world.lock()

    def ended(self, number: int, job_dir: Path, job_id: str | None, mirror: RunMirror) -> None:
        with self._lock:
            self._waiting[number] = (job_dir, job_id, mirror)
            self._take_finalized()

    def facts(self, number: int) -> JobFacts | None:
        """Trial ``number``'s facts, if this orchestrator ended it and its final record is written."""
        with self._lock:
            if self._waiting:
                self._take_finalized()
            return self._facts.get(number)

    def _take_finalized(self) -> None:
        for number in [n for n, (_, _, mirror) in self._waiting.items() if mirror.is_done]:
            job_dir, job_id, mirror = self._waiting.pop(number)
            self._facts[number] = JobFacts(job_dir, mirror.run_id, mirror.model_id, job_id)


class TrialDrivenElsewhere(JobError):
    """Another live orchestrator holds the trial's lease; this one follows it instead."""


class Tuner:
    """Drives one study. ``run`` is called once; ``run_trial`` from any number of threads."""

    def __init__(self, ctx: TuneContext) -> None:
        # First: everything below reads num_parallel as a number (the sampler's start-up trials too).
        ctx = replace(ctx, settings=resolve_num_parallel(ctx.step, ctx.settings, ctx.launcher))
        self.ctx = ctx
        self.settings = ctx.settings
        self.study = open_study(ctx.settings, ctx.storage)
        self.trials = StudyTrials(self.study)
        self.leases = Leases(private_job_dirs=ctx.launcher.private_job_dirs)
        self._distributions = distributions(ctx.settings.space)
        self.policy = make_policy(
            PolicyContext(
                settings=ctx.settings,
                trials=self.trials,
                jobs_dir=ctx.jobs_dir,
                job_dir=self._job_dir,
                distributions=self._distributions,
                job_writes_job_dir=ctx.launcher.job_writes_job_dir,
                launcher=ctx.launcher.kind,
            )
        )
        self._metrics = default_metrics().trial_observer(
            pipeline=ctx.pipeline, study=ctx.settings.study.name, step=ctx.step
        )
        self._held: dict[int, Lease] = {}
        self._abandoned: dict[int, str] = {}
        self._following: frozenset[int] = frozenset()
        self._lock = world.lock()
        self._run_reserve: RunReserve | None = None
        self._ended_here = EndedHere()

    @property
    def step(self) -> str:
        """The pipeline step this study runs in."""
        return self.ctx.step

    # ------------------------------------------------------------------------------------ the loop

    def run(self, submit: TrialSubmitter | None = None) -> TrialSet:
        """Bring the study to ``num_trials`` finished trials, ``num_parallel`` at a time. Each trial
        is driven on a thread of its own, or wherever ``submit`` runs it (a Prefect task run)."""
        self._catch_up_tracking()
        self._enqueue_first_trials()
        self._metrics.count_trials(self.trials.tally())
        watch.study_started(self._study_start())
        submit = submit or _on_a_thread
        self._run_reserve = self._open_run_reserve()
        flushed = False
        try:
            try:
                self._keep_trials_in_flight(submit)
            finally:
                # Leases taken for trials whose driver never started (a failed ask, a failed submit):
                # held on by this process's heartbeat, they would keep every later driver away for good.
                self._let_go_of_unstarted()
            flushed = self.ctx.outbox.flush(self.ctx.flush_timeout_s)
        finally:
            if self._run_reserve is not None:
                self._run_reserve.close(all_named=flushed)
        if self._abandoned:
            listed = "\n".join(f"trial {n}: {why}" for n, why in sorted(self._abandoned.items()))
            raise TunepodError(
                f"study {self.settings.study.name}: the orchestrator failed while driving "
                f"{len(self._abandoned)} trial(s); their jobs were left running and the trials unfinished. "
                f"Run the pipeline again to re-attach to them.\n{listed}"
            )
        return self.trial_set()

    def _open_run_reserve(self) -> RunReserve | None:
        in_flight = self.settings.num_parallel
        assert isinstance(in_flight, int), "resolved when the tuner was made"
        return self.ctx.open_run_reserve(in_flight) if self.ctx.open_run_reserve is not None else None

    def _keep_trials_in_flight(self, submit: TrialSubmitter) -> None:
        in_flight: dict[Future[TrialRecord], int] = {}
        while True:
            started, following, room = self._schedule(set(in_flight.values()))
            in_flight |= {submit(self, number): number for number in started}
            if not in_flight and not following and room <= 0:
                return
            if not in_flight:
                world.sleep(FOLLOW_POLL_S)
                continue
            timeout = FOLLOW_POLL_S if following or room > 0 else None
            for future in world.wait_any(in_flight, timeout):
                self._settled(in_flight.pop(future), future)

    def _let_go_of_unstarted(self) -> None:
        with self._lock:
            unstarted, self._held = list(self._held.values()), {}
        for lease in unstarted:
            lease.release()

    def _enqueue_first_trials(self) -> None:
        """The spec's known-good configurations and warm-start trials, queued once (under the study
        lock, so two orchestrators starting together queue each once)."""
        if not (self.settings.enqueue or self.settings.warm_start):
            return
        self.ctx.jobs_dir.mkdir(parents=True, exist_ok=True)
        with locked(self.ctx.jobs_dir / ".study.lock"):
            for line in enqueue_first_trials(self.study, self.settings):
                log.info("study %s: %s", self.settings.study.name, line)

    def _schedule(self, mine: set[int]) -> tuple[list[int], list[int], int]:
        """Under the study lock: claim unfinished trials nobody drives, then fill the free slots as
        the search policy plans (resume parked trials, ask new ones, end parked ones). Returns
        (trials to start driving, trials others drive, trials still to ask for).

        The cap is the study's, shared by every orchestrator on it: in flight is every trial RUNNING
        in Optuna and not parked, whoever drives it (this orchestrator, another live one, or nobody
        yet). A trial nobody drives (its orchestrator died) is claimed whatever the cap: its job runs
        already, and counts against the cap either way."""
        self.ctx.jobs_dir.mkdir(parents=True, exist_ok=True)
        with locked(self.ctx.jobs_dir / ".study.lock"):
            # Counted, not walked: a look at the study costs the trials in flight, not the study's size.
            tally = self.trials.tally()
            study = self._study_state(tally)
            running = [
                t for t in study.unfinished if t.state is TrialState.RUNNING and not self.policy.is_parked(t)
            ]
            claimed, following = self._claim(running, mine)
            self._announce_claims(claimed, study.unfinished)
            self._announce_following(following)
            room = self.policy.room(study)
            in_flight = self._in_flight(running, mine)
            capacity = self.settings.max_parallel - len(in_flight)
            plan = self.policy.plan(SlotView(study, frozenset(in_flight), capacity, room))
            asked = [self._ask(tally.num_trials + i) for i in range(plan.ask)]
            resumed = self._resume(study.unfinished, plan, capacity - len(asked))
            for number in plan.end if self._may_end_parked() else ():
                self._end_parked(number)
        return claimed + resumed + asked, following, room - len(asked)

    def _study_state(self, tally: Tally) -> StudyState:
        """The study for the policy: half-asked trials are not running anything (the next asks
        finish asking them), so they are left out."""
        return StudyState(
            unfinished=[t for t in tally.unfinished if not self._half_asked(t)],
            num_finished=sum(tally.finished.values()),
            read_trials=lambda: [t for t in self.trials.all() if not self._half_asked(t)],
        )

    def _in_flight(self, running: list[FrozenTrial], mine: set[int]) -> set[int]:
        """The trials whose jobs take a slot: those running and not parked, whoever drives them.
        Not those this orchestrator gave up driving (their jobs may still run): it ends with an error
        once the rest are done, and would otherwise wait for them forever. Nor its own (``mine``)
        that ended or were parked while their drivers are still returning: their jobs have ended
        (counted, a parked one made the study look busy to a policy that resumes parked trials while
        it is, and two orchestrators, each looking while the other drives, resumed every one)."""
        return {t.number for t in running} - set(self._abandoned)

    def _claim(self, running: list[FrozenTrial], mine: set[int]) -> tuple[list[int], list[int]]:
        """Of the running trials this orchestrator does not drive: those whose lease it could take
        (nobody drives them: claimed, to drive), and those another live orchestrator holds (followed)."""
        claimed, following = [], []
        for trial in running:
            if trial.number in mine or trial.number in self._abandoned:
                continue
            lease = self.leases.acquire(self._job_dir(trial))
            if lease is None:
                following.append(trial.number)
                continue
            self._hold(trial.number, lease)
            claimed.append(trial.number)
        return claimed, following

    def _resume(self, trials: Sequence[FrozenTrial], plan: Plan, capacity: int) -> list[int]:
        """Resume up to ``capacity`` of the plan's parked trials, in order: each one's resumption is
        recorded by the policy inside its lease's fence, before its new job is submitted."""
        by_number = {t.number: t for t in trials}
        resumed: list[int] = []
        for number in plan.resume[: max(capacity, 0)]:
            parked = by_number.get(number) or self.trials.frozen(number)
            lease = self.leases.acquire(self._job_dir(parked))
            if lease is None:
                continue  # another orchestrator is resuming or ending it
            with lease.fenced():
                line = self.policy.resume(number)
            if line is None:
                lease.release()  # resumed meanwhile, by one that has let go already
                continue
            log.info("%s", line)
            self._hold(number, lease)
            resumed.append(number)
        return resumed

    def _may_end_parked(self) -> bool:
        """Whether the policy's end of the study may be carried out: not while a trial this
        orchestrator gave up driving still runs, since it may still report. The run that re-attaches
        to it ends the parked trials, knowing its reports."""
        return not self._abandoned

    def _end_parked(self, number: int) -> None:
        """End a parked trial the policy gives up on: PRUNED, its MLflow run closed as KILLED."""
        trial = self.trials.frozen(number)
        lease = self.leases.acquire(self._job_dir(trial))
        if lease is None:
            return  # another orchestrator holds it: it ends or resumes it
        try:
            with lease.fenced():
                trial = self.trials.frozen(number)
                if not self.policy.is_parked(trial):
                    return
                params = {**self.settings.train.args, **trial.params}
                mirror = self._mirror(trial, params, {})
                log.info("trial %d: parked and never resumed; pruned at the end of the study", number)
                self.trials.tell(number, TrialState.PRUNED)
                self._close(number, mirror)
        finally:
            lease.release()

    def _ask(self, num_trials: int) -> int:
        """A new trial (under the study lock); the study holds ``num_trials`` trials before it."""
        reseed_for_next_trial(self.study, self.settings, num_trials)
        number = retried(self._new_trial)
        job_dir = self.ctx.jobs_dir / f"trial-{number}"
        set_aside_stale(job_dir)
        self.trials.set_attr(number, ATTR_JOB_DIR, str(job_dir))
        lease = self.leases.acquire(job_dir, wait=True)
        assert lease is not None, f"the new trial's job dir {job_dir} is leased already"
        self._hold(number, lease)
        self._metrics.count_trials(self.trials.tally())
        return number

    def _new_trial(self) -> int:
        """A trial with every parameter of the space: one that an interrupted ask left half asked (a
        storage error after Optuna created it, a crash before its job dir was recorded), else a new
        one. So a retried ask never leaves a trial behind, to be trained later with defaults."""
        half_asked = next((t for t in self.trials.unfinished() if self._half_asked(t)), None)
        if half_asked is None:
            return int(self.study.ask(self._distributions).number)
        log.warning(
            "study %s: trial %d was left half asked (parameters %s); asking the rest",
            self.settings.study.name,
            half_asked.number,
            sorted(half_asked.params),
        )
        self.trials.complete_params(half_asked.number, self._distributions)
        return half_asked.number

    def _hold(self, number: int, lease: Lease) -> None:
        with self._lock:
            self._held[number] = lease

    def _settled(self, number: int, future: Future[TrialRecord]) -> None:
        exc = future.exception()
        if exc is None:
            return
        # Another orchestrator drives the trial now, or has finished it (Optuna refuses a report on it).
        if isinstance(exc, TrialDrivenElsewhere | LeaseLost | UpdateFinishedTrialError):
            log.warning("trial %d: %s", number, exc)
            return
        self._abandoned[number] = f"{type(exc).__name__}: {exc}"
        log.error(
            "trial %d: the orchestrator failed while driving it (%r); its job is left running and the "
            "trial unfinished, so a later run re-attaches to it",
            number,
            exc,
        )

    def _announce_claims(self, claimed: list[int], trials: Sequence[FrozenTrial]) -> None:
        by_number = {t.number: t for t in trials}
        # Made whole by the policy (a continuation) and never started: nothing to re-attach to.
        fresh = [n for n in claimed if self.policy.owns(by_number[n]) and not self._started(by_number[n])]
        if fresh:
            log.info("study %s: starting trials %s", self.settings.study.name, fresh)
        unfinished = [n for n in claimed if n not in fresh]
        if unfinished:
            log.warning(
                "study %s: re-attaching to unfinished trials %s", self.settings.study.name, unfinished
            )

    def _announce_following(self, following: list[int]) -> None:
        if frozenset(following) != self._following and following:
            log.warning(
                "study %s: trials %s are driven by another orchestrator; following them",
                self.settings.study.name,
                following,
            )
        self._following = frozenset(following)

    # ------------------------------------------------------------------------------------ one trial

    def run_trial(self, number: int, links: TrialLinks | None = None) -> TrialRecord:
        """Drive trial ``number`` to a final state and return its record. Idempotent: a retry
        re-attaches to the job it started, and a finished trial is only read back."""
        lease = self._lease(number)
        links = links or TrialLinks()
        try:
            frozen = self.trials.frozen(number)
            if frozen.state in FINISHED or self.policy.is_parked(frozen):
                return self._record(frozen)
            params = {**self.settings.train.args, **frozen.params}
            mirror = self._mirror(frozen, params, links.tags)
            self.policy.before_job(frozen)
            try:
                layout = job_layout(self.settings.train.parallelism, self.settings.train.resources, params)
            except ValueError as exc:
                with lease.fenced():
                    self._prune_unfit_layout(number, mirror, str(exc))
                return self._ended(number, mirror)
            feed = ReportFeed(self, frozen, mirror)
            job = self._job_spec(number, params, mirror, layout)
            _announce_run(number, mirror, links)
            watch.trial_started(self.step, number)
            driver = JobDriver(
                self.ctx.launcher,
                job,
                self._drive_settings(frozen),
                what=f"Trial {number} of study {self.settings.study.name}",
                on_reports=feed,
                observe=self._observer(number, mirror),
                leases=self.leases,
            )
            driven = driver.run(lease)
            if driven.outcome is Outcome.STOPPED:
                self._stopped(number, feed, driven, lease, mirror)
            else:
                with lease.fenced():
                    self._conclude(number, driven, mirror, feed)
            return self._ended(number, mirror)
        finally:
            lease.release()

    def _stopped(
        self, number: int, feed: ReportFeed, driven: DriveResult, lease: Lease, mirror: RunMirror
    ) -> None:
        """A job the policy stopped has ended: the policy prepares its stop outside the fence (a
        checkpoint copy may be long), then records it inside, where the trial ends PRUNED (Optuna told,
        its MLflow run closed) or stays parked."""
        assert driven.reason is not None, "a stopped job has its reason"
        record = self.policy.stopped(self.trials.frozen(number), feed.judge, driven.reason)
        with lease.fenced():
            feed.tell_last_step()
            if record() is Ending.PRUNED:
                self._constrained(number, driven, feed)
                self.trials.tell(number, TrialState.PRUNED)
                self._close(number, mirror)

    def _ended(self, number: int, mirror: RunMirror) -> TrialRecord:
        """The record of trial ``number``, which this orchestrator just ended (or paused)."""
        frozen = self.trials.frozen(number)
        record = self._record(frozen)
        if frozen.state in FINISHED:
            self._ended_here.ended(number, Path(record.job_dir), record.job_id, mirror)
        log.info("%s", ending_line(record, self.step))
        watch.trial_ended(self.step, record)
        return record

    def _study_start(self) -> watch.StudyStart:
        """The study as a watcher sees it open: what earlier runs ended, and the best of it."""
        primary = self.settings.study.primary
        parked = self.policy.is_parked
        ended = [t for t in self.trials.all() if t.state in FINISHED or parked(t)]
        endings = Counter[str](ending_of(t, "PAUSED" if parked(t) else OUTCOME[t.state]) for t in ended)
        done = [(t.number, t.values[0]) for t in ended if t.state is TrialState.COMPLETE and t.values]
        sign = -1.0 if primary.direction == "maximize" else 1.0
        best = min(done, key=lambda trial: sign * trial[1], default=None)
        return watch.StudyStart(
            step=self.step,
            study=self.settings.study.name,
            num_trials=self.settings.num_trials,
            direction=primary.direction,
            metric=primary.metric,
            finished=dict(endings),
            best=best,
        )

    def _drive_settings(self, frozen: FrozenTrial) -> DriveSettings:
        attempts = self.policy.attempts(frozen)
        return DriveSettings(
            poll_s=self.settings.poll_s,
            max_restarts=self.settings.train.max_restarts + attempts.extra,
            resume_attempt=attempts.resume_attempt,
            kept_at_the_end=self.policy.stops_kept_at_the_end,
        )

    def _lease(self, number: int) -> Lease:
        with self._lock:
            held = self._held.pop(number, None)
        if held is not None and not held.lost:
            # Taken when the trial was scheduled, maybe long ago (a queued Prefect task run): make sure
            # it is still this orchestrator's before starting anything of the trial (its MLflow run).
            held.check()
            return held
        job_dir = self._job_dir(self.trials.frozen(number))
        lease = self.leases.acquire(job_dir)
        if lease is None:
            holder = self.leases.holder(job_dir)
            who = holder.describe() if holder is not None else "another orchestrator"
            raise TrialDrivenElsewhere(f"{job_dir} is driven by {who}")
        return lease

    def _observer(self, number: int, mirror: RunMirror) -> Callable[[JobHandle, bool], JobHandle]:
        def observe(handle: JobHandle, submitted: bool) -> JobHandle:
            self.trials.set_attr(number, ATTR_JOB_ID, handle.job_id)
            self.ctx.outbox.add(mirror)
            return self._metrics.submitted(handle) if submitted else self._metrics.attached(handle)

        return observe

    def run_url(self, run_id: str) -> str:
        """A trial's MLflow run in the MLflow UI."""
        return self.ctx.tracker.run_url(run_id, self.ctx.mlflow_ui_url)

    def _mirror(
        self, frozen: FrozenTrial, params: dict[str, object], extra_tags: Mapping[str, str]
    ) -> RunMirror:
        """The trial's MLflow run: taken from the runs made ahead, else found or created by the outbox
        (never by this thread)."""
        number = frozen.number
        plan = RunPlan(
            key=f"{self.settings.study.name}/trial-{number}",
            name=f"trial-{number}",
            parent_run_id=self.ctx.parent_run_id,
            tags={
                tags.TRIAL: str(number),
                tags.STUDY: self.settings.study.name,
                tags.STEP: self.ctx.step,
                tags.STATE: "RUNNING",
                tags.LAUNCHER: self.ctx.launcher.kind,
                **self.policy.tags(frozen),
                **extra_tags,
            },
            params=params,
        )
        recorded = frozen.user_attrs.get(ATTR_RUN_ID)
        mirror = RunMirror(
            self.ctx.tracker,
            self._job_dir(frozen),
            plan=plan,
            run_id=str(recorded) if recorded else None,
            reserve=self._run_reserve,
        )
        self.ctx.outbox.add(mirror)
        return mirror

    def _job_spec(
        self, number: int, params: dict[str, object], mirror: RunMirror, layout: Parallelism | None
    ) -> JobSpec:
        job_dir = self._job_dir(self.trials.frozen(number))
        run_id = mirror.wait_for_run(RUN_ID_WAIT_S)
        if run_id is not None:
            self.trials.set_attr(number, ATTR_RUN_ID, run_id)
        return trial_job_spec(
            self.settings,
            number,
            job_dir,
            params,
            data_dir=self.ctx.dataset.path,
            tracking_uri=self.ctx.tracker.tracking_uri,
            run_id=run_id,
            layout=layout,
        )

    # ------------------------------------------------------------------------------------ outcomes

    def _conclude(self, number: int, driven: DriveResult, mirror: RunMirror, feed: ReportFeed) -> None:
        """Tell Optuna the outcome (the truth), then hand the final record to the outbox."""
        feed.tell_last_step()
        constrained = self._constrained(number, driven, feed) if driven.outcome is Outcome.COMPLETED else {}
        if driven.outcome is Outcome.COMPLETED:
            values = {goal.metric: feed.objective(driven, goal.metric) for goal in self.settings.study.goals}
            missing = [metric for metric, value in (values | constrained).items() if value is None]
            if feed.last_step is not None and self.settings.study.multi_objective:
                self.trials.set_attr(number, ATTR_LAST_STEP, feed.last_step)
            if not missing:
                self.trials.tell(number, TrialState.COMPLETE, [v for v in values.values() if v is not None])
                if is_feasible(self.trials.frozen(number)) is False:
                    log.info("trial %d is infeasible (%s)", number, "; ".join(self.settings.constraints))
            else:
                listed = ", ".join(f"{m}=..." for m in missing)
                self._fail(
                    number,
                    f"Trial {number} finished without reporting {', '.join(map(repr, missing))}; fix: report "
                    f"it with ctx.report(step, {listed}) or ctx.finish({listed}) in "
                    f"{self.settings.train.entrypoint}",
                )
        else:
            self._fail(number, driven.message)
        self._close(number, mirror)

    def _constrained(self, number: int, driven: DriveResult, feed: ReportFeed) -> dict[str, float | None]:
        """The constrained metrics' values; their violations recorded on the trial when all are known,
        before it is told (samplers read them then)."""
        constrained = {c.metric: feed.objective(driven, c.metric) for c in self.settings.parsed_constraints}
        if None not in constrained.values():
            violations = {
                str(c): c.violation(constrained[c.metric] or 0.0) for c in self.settings.parsed_constraints
            }
            self.trials.set_constraints(number, violations)
        return constrained

    def _prune_unfit_layout(self, number: int, mirror: RunMirror, why: str) -> None:
        """Prune, without a job, a trial whose sampled layout does not fit its resources.

        Every searched value fits some layout (checked at spec load), but not every combination can
        (tensor 4 x pipeline 2 on 4 processes). Pruned rather than failed: TPE ranks pruned trials
        below completed ones and so learns to avoid the combination, where it ignores failed ones.
        """
        message = f"Trial {number}: its sampled layout does not fit, pruned before any job ran: {why}"
        log.warning("%s", message)
        self.trials.set_attr(number, ATTR_ERROR, message[-4000:])
        self.trials.tell(number, TrialState.PRUNED)
        self._close(number, mirror)

    def _close(self, number: int, mirror: RunMirror) -> None:
        """After Optuna was told: hand the final record to the outbox and count the trial."""
        finished = self.trials.frozen(number)
        mirror.finish(self._final(finished))
        self.ctx.outbox.add(mirror)
        self._metrics.finished(self._job_dir(finished), OUTCOME[finished.state])
        self._metrics.count_trials(self.trials.tally())

    def _fail(self, number: int, message: str) -> None:
        log.error("%s", message)
        self.trials.set_attr(number, ATTR_ERROR, message[-4000:])
        self.trials.tell(number, TrialState.FAIL)

    def _final(self, frozen: FrozenTrial) -> Final:
        """The MLflow record of a finished trial, from Optuna and its job dir alone (so a later run can
        write it again after a crash)."""
        final = self._final_record(frozen)
        return replace(final, tags={**final.tags, **self.policy.tags(frozen)})

    def _final_record(self, frozen: FrozenTrial) -> Final:
        state = OUTCOME[frozen.state]
        status = RUN_STATUS[frozen.state]
        paths = JobPaths(self._job_dir(frozen))
        last_step = self._last_step(frozen)
        if frozen.state is TrialState.FAIL:
            error = frozen.user_attrs.get(ATTR_ERROR)
            return Final(tags={tags.STATE: state}, status="FAILED", error=str(error) if error else None)
        # As the metadata says: the mirror verifies the checkpoint it logs as the model, and nothing
        # else here loads one (hashing every kept state at every trial's end would reread them all).
        saved = saved_checkpoints(paths.checkpoints)
        checkpoints = tuple(c.path for c in saved)
        if frozen.state is TrialState.PRUNED:
            return Final(
                tags={tags.STATE: state, tags.PRUNED_AT_STEP: last_step},
                status="KILLED",
                checkpoints=checkpoints,
            )
        assert frozen.values is not None and frozen.datetime_complete is not None
        # At the trial's last step, so the metric's history has no stray point at step 0 (the mirror
        # skips it when the job's own report of that step is that very point).
        objectives = tuple(
            Point(
                goal.metric, value, last_step, timestamp_ms=int(frozen.datetime_complete.timestamp() * 1000)
            )
            for goal, value in zip(self.settings.study.goals, frozen.values, strict=True)
        )
        latest = saved[0] if saved else None
        model = None
        if latest is not None:
            params = {**self.settings.train.args, **frozen.params}
            name = f"{self.settings.study.name}-trial-{frozen.number}"
            model = ModelPlan(latest.path, name=name, step=latest.step, params=params)
        feasible = is_feasible(frozen)
        return Final(
            tags={tags.STATE: state} | ({} if feasible is None else {tags.FEASIBLE: str(feasible).lower()}),
            status=status,
            metrics=objectives,
            model=model,
            checkpoints=checkpoints,
        )

    def _catch_up_tracking(self) -> None:
        """Finished trials whose MLflow record a crash or an outage left unwritten get it now."""
        for frozen in self.trials.all():
            if frozen.state not in FINISHED:
                continue
            job_dir = self._job_dir(frozen)
            if not JobPaths(job_dir).tracking.exists() or read_mirror_state(job_dir).finalized:
                continue
            params = {**self.settings.train.args, **frozen.params}
            mirror = self._mirror(frozen, params, {})
            mirror.finish(self._final(frozen))
            self.ctx.outbox.add(mirror)

    # ------------------------------------------------------------------------------------ reading

    def _half_asked(self, trial: FrozenTrial) -> bool:
        """A trial Optuna created for an ask that never finished: every finished ask records its job
        dir (under the study lock, so nobody sees an ask in progress). One the policy made whole (a
        continuation) never is."""
        return (
            trial.state is TrialState.RUNNING
            and ATTR_JOB_DIR not in trial.user_attrs
            and not self.policy.owns(trial)
        )

    def _started(self, trial: FrozenTrial) -> bool:
        """A job was ever submitted for ``trial``."""
        return read_submission(JobPaths(self._job_dir(trial))) is not None

    def _last_step(self, frozen: FrozenTrial) -> int | None:
        """The trial's last reported step; one that reported none ends where it started."""
        step = frozen.user_attrs.get(ATTR_LAST_STEP)
        if step is None:
            step = self.policy.first_step(frozen)
        return max(frozen.intermediate_values, default=int(step) if step is not None else None)

    def _job_dir(self, frozen: FrozenTrial) -> Path:
        return Path(frozen.user_attrs.get(ATTR_JOB_DIR, self.ctx.jobs_dir / f"trial-{frozen.number}"))

    def _job_facts(self, frozen: FrozenTrial) -> JobFacts:
        if frozen.state in FINISHED and (known := self._ended_here.facts(frozen.number)) is not None:
            return known
        job_dir = self._job_dir(frozen)
        mirrored = read_mirror_state(job_dir)
        submitted = read_submission(JobPaths(job_dir)) if job_dir.exists() else None
        return JobFacts(job_dir, mirrored.run_id, mirrored.model_id, submitted.job_id if submitted else None)

    def _record(self, frozen: FrozenTrial) -> TrialRecord:
        facts = self._job_facts(frozen)
        completed = frozen.state is TrialState.COMPLETE and frozen.values is not None
        metrics = [goal.metric for goal in self.settings.study.goals]
        outcome: TrialOutcome = (
            "PAUSED" if self.policy.is_parked(frozen) else OUTCOME.get(frozen.state, "FAIL")
        )
        error = frozen.user_attrs.get(ATTR_ERROR)
        return TrialRecord(
            number=frozen.number,
            outcome=outcome,
            params={**self.settings.train.args, **frozen.params},
            value=frozen.values[0] if completed else None,
            values=dict(zip(metrics, frozen.values, strict=True)) if completed else {},
            last_step=self._last_step(frozen),
            run_id=facts.run_id or frozen.user_attrs.get(ATTR_RUN_ID),
            job_id=facts.job_id or frozen.user_attrs.get(ATTR_JOB_ID),
            job_dir=str(facts.job_dir),
            checkpoint_dir=str(JobPaths(facts.job_dir).checkpoints),
            model_id=facts.model_id,
            error=error,
            feasible=is_feasible(frozen) if completed else None,
            ending=ending_of(frozen, outcome),
            why=why_ended(frozen, self.settings.pruner.kind, error),
        )

    def trial_set(self) -> TrialSet:
        trials = [t for t in self.trials.all() if t.state in FINISHED]
        study = self.settings.study
        goals = study.goals if study.multi_objective else []
        return TrialSet(
            step=self.ctx.step,
            study=self.settings.study.name,
            metric=self.settings.study.primary.metric,
            direction=self.settings.study.primary.direction,
            dataset=self.ctx.dataset,
            trials=[self._record(t) for t in trials],
            objectives=[Goal(metric=g.metric, direction=g.direction) for g in goals],
        )


class ReportFeed:
    """A trial's reports -> Optuna and the outbox; the driver calls it with the reports that appeared
    since its last call (all of them again after an orchestrator restart), and it answers True when
    the pruner says stop. It keeps each objective's (and constrained metric's) last reported value for
    ``objective``: Optuna stores intermediate values for single-objective studies only.

    Optuna is told the primary metric's value at the steps ``next_step_to_tell`` picks (every step of
    a trial's first 1,000, then about 900 per tenfold), and at the trial's last step when it ends
    (``tell_last_step``): a job may report 100,000 steps, and Optuna's journal storage copies all of a
    trial's values on each new one. The pruner is asked once per call, and only when it was told
    something new. The steps told follow from the reports alone, so a restarted orchestrator that
    reads them again tells the same ones."""

    def __init__(self, tuner: Tuner, frozen: FrozenTrial, mirror: RunMirror) -> None:
        self._tuner = tuner
        self._mirror = mirror
        self._number = frozen.number
        self._study = tuner.settings.study
        self._told = max(frozen.intermediate_values, default=-1)
        # A driver that takes over a trial judges the value Optuna holds at its first look: the one
        # before it may have told that value and died before judging it.
        self._first_look = bool(frozen.intermediate_values)
        self._untold: Report | None = None
        self._live: optuna.trial.Trial | None = None
        self.judge: JobJudge | None = tuner.policy.judge(frozen)
        """The search policy's judge of this job (None: it never stops one)."""
        # The objectives' and the constraints' metrics: their last reports are the trial's values.
        constrained = [c.metric for c in tuner.settings.parsed_constraints]
        self._metrics = list(dict.fromkeys([goal.metric for goal in self._study.goals] + constrained))
        self.last_step: int | None = None
        self.latest: dict[str, float] = {}

    def __call__(self, reports: list[Report]) -> CancelReason | None:
        self._tuner.ctx.outbox.add(self._mirror)
        for report in reports:
            self.last_step = max(report.step, self.last_step or 0)
            self.latest |= {m: report.metrics[m] for m in self._metrics if m in report.metrics}
        if self._study.multi_objective:
            return None  # nothing to tell Optuna before the end, and no pruner (refused at spec load)
        metric = self._study.primary.metric
        told = False
        for report in reports:
            if report.step <= self._told or metric not in report.metrics:
                continue  # told already (a resumed job redoes steps), or not about the objective
            if report.step >= next_step_to_tell(self._told):
                self._tell(report)
                told = True
            elif self._untold is None or report.step >= self._untold.step:
                self._untold = report
        first_look = self._first_look and bool(reports)
        if reports:
            self._first_look = False
        if not (told or first_look) or self.judge is None:
            return None
        # On the newest step Optuna holds, not the newest reported: past step 1,000 Optuna is told
        # only some steps, and a decision must read what every orchestrator on the study can read.
        return self.judge.judge(Told(self._number, self._told, self._trial, self._tuner.trials.all))

    def tell_last_step(self) -> None:
        """Tell Optuna the newest value it was not told, so that the trial's intermediate values end at
        its last step (TPE ranks pruned trials by it; Hyperband sizes its brackets by it)."""
        if self._untold is not None and self._untold.step > self._told:
            self._tell(self._untold)

    def _tell(self, report: Report) -> None:
        value = report.metrics[self._study.primary.metric]
        live = self._trial()
        retried(lambda: live.report(value, report.step))
        self._told = report.step
        self._untold = None

    def _trial(self) -> optuna.trial.Trial:
        """One ``optuna.trial.Trial`` for the trial's whole run, as ``study.optimize`` keeps: making one
        reads the trial from the storage, with every value it was told."""
        if self._live is None:
            self._live = self._tuner.trials.live(self._number)
        return self._live

    def objective(self, driven: DriveResult, metric: str) -> float | None:
        """An objective's value: what the job passed to ``finish``, else the last value it reported."""
        if driven.result is not None and metric in driven.result.metrics:
            value = float(driven.result.metrics[metric])
            return value if math.isfinite(value) else None
        if metric in self.latest:
            return float(self.latest[metric])
        frozen = self._tuner.trials.frozen(self._number)
        if metric == self._study.primary.metric and frozen.intermediate_values:
            return float(frozen.intermediate_values[max(frozen.intermediate_values)])
        return None


def trial_job_spec(
    settings: TuneSettings,
    number: int,
    job_dir: Path,
    params: Mapping[str, object],
    *,
    data_dir: str,
    tracking_uri: str | None,
    run_id: str | None,
    layout: Parallelism | None,
) -> JobSpec:
    """The job of trial ``number`` (pure): what the tuner submits, and what ``tunepod render`` shows."""
    env = contract_env(
        JobPaths(job_dir),
        params=script_params(params),
        data_dir=data_dir,
        trial=str(number),
        tracking_uri=tracking_uri,
        run_id=run_id,
        parallelism=layout,
        checkpoint_tiers=None if settings.train.checkpoints is None else settings.train.checkpoints.tiers(),
    )
    return JobSpec(
        name=f"{settings.study.name}-trial-{number}",
        entrypoint=Path(settings.train.entrypoint).resolve(),
        job_dir=job_dir,
        env=env,
        resources=settings.train.resources,
        limits=Limits.of(settings.train.resources, settings.train),
    )


def _on_a_thread(tuner: Tuner, number: int) -> Future[TrialRecord]:
    """The default ``TrialSubmitter``: drive the trial on a thread of this process."""
    future: Future[TrialRecord] = Future()

    def drive() -> None:
        try:
            future.set_result(tuner.run_trial(number))
        except BaseException as exc:  # handed to the loop, which decides what it means
            future.set_exception(exc)

    world.start_thread(drive, f"trial-{number}")
    return future


def _announce_run(number: int, mirror: RunMirror, links: TrialLinks) -> None:
    """Tell ``links`` the trial's MLflow run, if it exists by now (MLflow may be away: then the UI
    goes without the link, and the trial without waiting)."""
    run_id = mirror.run_id
    if links.on_run is None or run_id is None:
        return
    try:
        links.on_run(run_id)
    except Exception as exc:  # a UI link is never worth a trial
        log.warning("trial %d: could not link its MLflow run %s: %s", number, run_id, exc)


def next_step_to_tell(told: int) -> int:
    """The first step whose value Optuna is told after step ``told`` (-1: none yet): every step below
    1,000, then the steps of three significant digits (every 10th below 10,000, every 100th below
    100,000...), or the first step reported past one. Optuna keeps every value in memory and in its
    storage, and its journal storage copies a trial's values on each new one, so telling it 100,000
    steps would cost time quadratic in them; a pruner needs no finer steps. Every trial of a study
    reporting the same steps is told the same ones, so a median pruner still compares at equal steps."""
    spacing = int(10 ** max(0, len(str(told + 1)) - _DENSE_STEPS_DIGITS))
    return (told // spacing + 1) * spacing


def require_completed(trials: TrialSet) -> TrialSet:
    """Fail the tune step when no trial completed, quoting the first failure, or when none that
    completed met the study's constraints."""
    if trials.eligible():
        return trials
    if trials.completed():
        raise JobError(
            f"study {trials.study}: {len(trials.completed())} trials completed and none met the study's "
            "constraints (each trial's MLflow run has its tunepod.feasible tag); fix: loosen the "
            "constraints or move the search space toward feasible values, then run again to add trials"
        )
    failures = [t for t in trials.trials if t.outcome == "FAIL"]
    detail = failures[0].error if failures and failures[0].error else "every trial was pruned"
    raise JobError(
        f"study {trials.study}: none of {len(trials.trials)} trials completed. First failure:\n{detail}"
    )
