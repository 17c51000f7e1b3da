"""The defects the simulation must find: each fix of issue 28 undone again, one at a time.

A mutant puts one old behaviour back (by patching the running code, never the files); the
simulation, run over seeds with the mutant in place, must break an invariant. ``python -m simulation
--mutants`` runs them all and says which seed found each one (and fails if one goes unnoticed):
proof that the invariants can fail, and a measure of how many seeds a kind of defect needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from simulation.backends import KINDS
from tunepod.errors import JobError
from tunepod.hpo import population, study, tuner
from tunepod.hpo import study as hpo_study
from tunepod.hpo.asha import ATTR_ASHA, Asha, AshaState, is_paused
from tunepod.hpo.policies import asha as asha_policy
from tunepod.hpo.policies.contract import Attempts, Plan, SlotView, Told
from tunepod.hpo.trials import StudyTrials
from tunepod.launch import base, drive, lease
from tunepod.launch.hyperpod_eks import launcher as eks_launcher
from tunepod.launch.local import LocalLauncher, LocalStatus
from tunepod.launch.paths import JobPaths
from tunepod.launch.sagemaker import states as sagemaker_states
from tunepod.launch.slurm import launcher as slurm_launcher
from tunepod.launch.slurm import render
from tunepod.launch.slurm import states as slurm_states
from tunepod.launch.submission import write_cancel_marker
from tunepod.launch.watchdog import Stall, Watchdog
from tunepod.locks import locked
from tunepod.runtime import Result, checkpoints, files, memory_store, metrics, progress
from tunepod.runtime.checkpoints import CheckpointInfo
from tunepod.runtime.progress import RankProgress, read_progress
from tunepod.spec.models import PrunerSpec
from tunepod.steps import jobs, train
from tunepod.steps.context import StepContext
from tunepod.tracking.mirror import RunMirror
from tunepod.tracking.outbox import TrackingOutbox


@dataclass(frozen=True)
class Mutant:
    name: str
    defect: str
    apply: Callable[[], contextlib.AbstractContextManager[None]]
    kinds: tuple[str, ...] = KINDS
    """The backends whose seeds can show it (a defect of one launcher: its seeds only)."""
    found_by: int | None = None
    """A seed known to find it, tried before the hunted range: a rare defect's seed (the one that
    found it in the library) may lie beyond the first thousand."""


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, original)


def _leases_leak() -> contextlib.AbstractContextManager[None]:
    return _patched(tuner.Tuner, "_let_go_of_unstarted", lambda self: None)


def _half_asked_trained() -> contextlib.AbstractContextManager[None]:
    def never(self: tuner.Tuner, trial: FrozenTrial) -> bool:
        return False

    return _patched(tuner.Tuner, "_half_asked", never)


def _unfenced() -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def fenced_without_a_check(self: lease.Lease) -> Iterator[None]:
        with locked(JobPaths(self.job_dir).lease_lock):
            yield

    return _patched(lease.Lease, "fenced", fenced_without_a_check)


def _host_clock_trusted() -> contextlib.AbstractContextManager[None]:
    """The watchdog before: idleness and run time on the driver's wall clock alone."""

    def stall(self: Watchdog, job_id: str, now: float) -> Any:
        limit = self.limits.hang_timeout_s
        beats = [beat for beat in read_progress(self.paths.progress) if not beat.finished]
        stalled = [beat for beat in beats if limit is not None and now - beat.advanced_at > limit]
        return _OldStall(stalled) if stalled else None

    def timed_out(self: Watchdog, job_id: str, now: float) -> bool:
        limit = self.limits.timeout_s
        return limit is not None and now - self.running_since(job_id) > limit

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(Watchdog, "stall", stall))
    stack.enter_context(_patched(Watchdog, "timed_out", timed_out))
    return stack  # type: ignore[return-value]


@dataclass(frozen=True)
class _OldStall:
    beats: list[Any]

    def describe(self) -> str:
        return f"{len(self.beats)} rank(s) stalled (by the driver's wall clock)"


def _purged_is_failed() -> contextlib.AbstractContextManager[None]:
    return _patched(render, "exit_code_trap", lambda paths: [])


def _leftovers_ignored() -> contextlib.AbstractContextManager[None]:
    """The local launcher before: a wrapper's recorded exit code ends the job, whatever still runs."""

    def ended(self: LocalLauncher, job_id: str, record: object, code: int, found: object) -> LocalStatus:
        return LocalStatus(running=False, exit_code=code)

    return _patched(LocalLauncher, "_sweep_leftovers", ended)


def _forgotten_intent_sent_again() -> contextlib.AbstractContextManager[None]:
    """The Slurm launcher before: an intent whose job ran and was purged, with no accounting, is sent
    again, whatever its script recorded."""
    return _patched(slurm_launcher, "_ended_and_forgotten", lambda intent, job_dir: None)


def _requeued_is_failed() -> contextlib.AbstractContextManager[None]:
    """Slurm's states with a requeued job read as failed, as if its node's failure had ended it."""
    table = {**slurm_states.SLURM_STATES, "REQUEUED": base.JobState.FAILED}
    return _patched(slurm_states, "SLURM_STATES", table)


def _node_fail_is_cancelled() -> contextlib.AbstractContextManager[None]:
    """Slurm's states with NODE_FAIL read as a cancel (the controller killed the job), which no
    restart follows."""
    table = {**slurm_states.SLURM_STATES, "NODE_FAIL": base.JobState.CANCELLED}
    return _patched(slurm_states, "SLURM_STATES", table)


def _left_behind_beats_count() -> contextlib.AbstractContextManager[None]:
    """The watchdog before: every heartbeat in the job dir is the current run's, the beats of a rank
    that a lost node left behind (live after the requeue or the restart) included."""

    def every_beat(self: Watchdog) -> list[RankProgress]:
        return read_progress(self.paths.progress)

    return _patched(Watchdog, "_beats", every_beat)


def _decided_stop_wins() -> contextlib.AbstractContextManager[None]:
    return _patched(drive.JobDriver, "_ended_on_its_own", lambda self, handle, state: False)


def _stopped_upload_cancelled() -> contextlib.AbstractContextManager[None]:
    """SageMaker's states before: a job stopped while its output uploaded (its script had exited 0,
    ``Uploading`` before ``Stopping`` in its transitions) is CANCELLED, as if the stop ended its training."""
    return _patched(sagemaker_states, "trained_before_stop", lambda transitions: False)


def _wall_clock_timeout() -> contextlib.AbstractContextManager[None]:
    """The watchdog before: a job without heartbeats times out on the driver's wall clock alone."""

    def timed_out(self: Watchdog, job_id: str, now: float) -> bool:
        limit = self.limits.timeout_s
        if limit is None or not self._wall_clock_past(job_id, now, limit):
            return False
        ranks = self._ranks()
        return not ranks or max(ran + rank.beat.interval_s for rank, ran in ranks) > limit

    return _patched(Watchdog, "timed_out", timed_out)


def _ttl_deleted_is_failed() -> contextlib.AbstractContextManager[None]:
    """The HyperPod EKS launcher before: a gone object is FAILED whatever its pods recorded."""
    return _patched(eks_launcher, "_recorded_exit", lambda job: None)


def _sent_intent_refused() -> contextlib.AbstractContextManager[None]:
    """The template before: a submit retried after a lost create reply and a failed look-up finds its
    intent's job and refuses it while it runs (the trial abandoned), or starts a new attempt beside it
    once it ended (the attempt run twice)."""
    return _patched(base, "_intent_was_sent", lambda previous: False)


def _gone_intent_sent_again() -> contextlib.AbstractContextManager[None]:
    """The HyperPod EKS launcher before: an intent whose object is gone (its TTL deleted it before its
    creation reached the record) is sent again, whatever its pods recorded."""
    return _patched(eks_launcher, "_ended_unrecorded", lambda intent, job_dir: False)


def _pause_recorded_at_the_decision() -> contextlib.AbstractContextManager[None]:
    """ASHA recording a pause as it decides it (from the report feed, outside the fence), before the
    job has stopped: a paused trial with a live job, which a restarted orchestrator would promote."""
    decide = asha_policy._PauseAtRungs.judge

    def record_at_once(self: asha_policy._PauseAtRungs, told: Told) -> str | None:
        reason = decide(self, told)
        if reason == asha_policy.PAUSED and self.paused_rung is not None:
            state = AshaState(self.paused_rung, True, attempt=1)
            StudyTrials(told.live().study).set_attr(told.number, ATTR_ASHA, state.to_attr())
        return reason

    return _patched(asha_policy._PauseAtRungs, "judge", record_at_once)


def _continued_without_looking() -> contextlib.AbstractContextManager[None]:
    """PBT creating an exploited trial's continuation without first looking for one: a rerun after a
    crash between the creation and the exploited trial's PRUNED creates a second, and the member
    trains twice."""
    return _patched(population.Population, "continuation_of", lambda self, number: None)


def _train_step_leaks_lease() -> contextlib.AbstractContextManager[None]:
    """A train step's ``run_job`` releasing its lease only when the drive returns (no ``finally``): a
    drive that raises (a full disk, a lost lease) leaves the lease held, renewed by the process's
    heartbeat, and every later driver of the job dir (the step's own retry too) follows it forever."""

    def run_job(ctx: StepContext, job: jobs.StepJob, mirror: RunMirror) -> Result:
        leases = lease.Leases(private_job_dirs=ctx.launcher.private_job_dirs)
        held = drive.acquire_or_follow(leases, job.job_dir, what=job.what, poll_s=jobs.POLL_S)
        driven = jobs._driver(ctx, job, mirror, leases).run(held)
        held.release()
        if driven.outcome is drive.Outcome.COMPLETED and driven.result is not None:
            return driven.result
        raise JobError(driven.message or f"{job.what} exited 0 without a result file")

    return _patched(train, "run_job", run_job)


def _preempted_is_completed() -> contextlib.AbstractContextManager[None]:
    """The driver reading a job that exited 0 as completed, whatever stop signal its script saved and
    exited on (a preemption): the run ends there, unfinished, its trial COMPLETE or its step failed."""
    return _patched(
        drive.JobDriver, "_ended_on_its_own", lambda self, handle, state: state is base.JobState.SUCCEEDED
    )


def _started_at_first_step() -> contextlib.AbstractContextManager[None]:
    """The watchdog counting a job as started at its first step rather than its first heartbeat: a
    healthy job whose first step takes longer than the start-up timeout is stopped as hung."""
    stall = Watchdog.stall

    def started_at_first_step(self: Watchdog, job_id: str, now: float) -> Any:
        limit = self.limits.startup_timeout_s
        ranks = self._ranks()
        if limit is None or not ranks or any(rank.beat.step is not None for rank, _ in ranks):
            return stall(self, job_id, now)
        ran = max(ran for _, ran in ranks)
        return Stall(ran, [], []) if ran > limit else None

    return _patched(Watchdog, "stall", started_at_first_step)


def _fence_checked_before_lock() -> contextlib.AbstractContextManager[None]:
    """The fence checking the lease before it takes the lease lock: a holder that stalls between the
    check and the lock, past its TTL, acts while another driver holds the lease."""

    @contextlib.contextmanager
    def check_then_lock(self: lease.Lease) -> Iterator[None]:
        with self._fence_thread:
            if self._fence_depth:
                self._fence_depth += 1
                try:
                    yield
                finally:
                    self._fence_depth -= 1
                return
            self.leases.check(self)
            with locked(JobPaths(self.job_dir).lease_lock):
                self._fence_depth = 1
                try:
                    yield
                finally:
                    self._fence_depth = 0

    return _patched(lease.Lease, "fenced", check_then_lock)


def _readded_mirror_dropped() -> contextlib.AbstractContextManager[None]:
    """The outbox ending a sync by dropping its mirror, whether or not a driver added it again while
    the sync was under way: what that driver added (a report, the final record) never reaches MLflow."""

    def synced(self: TrackingOutbox, mirror: RunMirror, version: int) -> None:
        with self._cond:
            self._syncing.discard(id(mirror))
            self._waiting.pop(id(mirror), None)
            self._failing_since = None
            self._cond.notify_all()

    return _patched(TrackingOutbox, "_synced", synced)


def _lease_handed_back() -> contextlib.AbstractContextManager[None]:
    """Leases before: ``acquire`` hands the same lease back to its owner, and the fence counts re-entry
    per lease, not per thread: a promotion enters a paused trial's fence while the trial's own driver
    is still inside it recording the pause, and starts a job the driver then records as paused."""
    acquire = lease.Leases.acquire

    def handed_back(self: lease.Leases, job_dir: Path, *, wait: bool = False) -> lease.Lease | None:
        held = self._held.get(job_dir)
        return held if held is not None and not held.lost else acquire(self, job_dir, wait=wait)

    @contextlib.contextmanager
    def fenced_per_lease(self: lease.Lease) -> Iterator[None]:
        if self._fence_depth:
            self._fence_depth += 1
            try:
                yield
            finally:
                self._fence_depth -= 1
            return
        with locked(JobPaths(self.job_dir).lease_lock):
            self.leases.check(self)
            self._fence_depth = 1
            try:
                yield
            finally:
                self._fence_depth = 0

    stack = contextlib.ExitStack()
    stack.enter_context(_patched(lease.Leases, "acquire", handed_back))
    stack.enter_context(_patched(lease.Lease, "fenced", fenced_per_lease))
    return stack  # type: ignore[return-value]


def _no_marker_for_an_ended_job() -> contextlib.AbstractContextManager[None]:
    """``Job.cancel`` before: a job that has already ended gets no cancel marker, so a stop decided
    as it died (a PBT exploit, a prune) lives only in the deciding driver's memory; the orchestrator
    after a crash reads the dead job as a failure, restarts it or tells FAIL."""

    def cancel(self: base.Job[Any], reason: Any = "cancelled") -> None:
        with self._cancel_lock:
            if self.status(max_age_s=0).job_state.is_terminal:
                return
            if self.cancel_marker() is None:
                write_cancel_marker(self.paths, self.job_id, reason)
            self.launcher.stop(self)
            self._wait_until_ended()

    return _patched(base.Job, "cancel", cancel)


def _partial_line_consumed() -> contextlib.AbstractContextManager[None]:
    """``ReportTail`` splitting what it read with ``splitlines``: a line still being written (or torn)
    is taken for a whole one, skipped as malformed and passed, and its report, once written whole, is
    never read."""

    def read_new_with_ends(self: metrics.ReportTail) -> list[tuple[metrics.Report, int]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        reports = []
        for raw in data.splitlines(keepends=True):
            self.offset += len(raw)
            report = metrics._parse_report(raw.decode("utf-8", errors="replace"))
            if report is not None:
                reports.append((report, self.offset))
        return reports

    return _patched(metrics.ReportTail, "read_new_with_ends", read_new_with_ends)


def _glued_onto_torn_line() -> contextlib.AbstractContextManager[None]:
    """``append_line_durably`` without its look at the file's last byte: the report appended after a
    torn line is glued onto it, and both are lost."""

    def append(path: Path, line: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        files.append_whole(path, line.encode("utf-8") + b"\n")

    return _patched(files, "append_line_durably", append)


def _dense_below_a_hundred() -> contextlib.AbstractContextManager[None]:
    """Optuna told every step below 100 only (two dense digits), then one step in ten."""
    return _patched(tuner, "_DENSE_STEPS_DIGITS", 2)


def _last_step_untold() -> contextlib.AbstractContextManager[None]:
    """A trial's last step not told as it ends: its intermediate values stop at the last step on the
    grid of ``next_step_to_tell``."""
    return _patched(tuner.ReportFeed, "tell_last_step", lambda self: None)


def _objective_from_reports() -> contextlib.AbstractContextManager[None]:
    """A trial's value from its last report first, the result file (``ctx.finish``) only without one."""
    objective = tuner.ReportFeed.objective

    def last_report_first(self: tuner.ReportFeed, driven: Any, metric: str) -> float | None:
        if metric in self.latest:
            return float(self.latest[metric])
        return objective(self, driven, metric)

    return _patched(tuner.ReportFeed, "objective", last_report_first)


def _enqueued_again() -> contextlib.AbstractContextManager[None]:
    """The spec's configurations enqueued on every run of the study, the ones it holds already too."""

    def enqueue(study: optuna.Study, params: dict[str, Any]) -> bool:
        study.enqueue_trial(params)
        return True

    return _patched(hpo_study, "_enqueue", enqueue)


def _enqueued_unlocked() -> contextlib.AbstractContextManager[None]:
    """The spec's configurations enqueued outside the study lock: two orchestrators starting together
    both find a configuration missing, and both enqueue it."""

    def enqueue_first_trials(self: tuner.Tuner) -> None:
        for line in hpo_study.enqueue_first_trials(self.study, self.settings):
            tuner.log.info("study %s: %s", self.settings.study.name, line)

    return _patched(tuner.Tuner, "_enqueue_first_trials", enqueue_first_trials)


def _promotions_eat_restarts() -> contextlib.AbstractContextManager[None]:
    """A promoted trial's drive with only ``max_restarts``: its promotions, attempts that are no
    restarts, spend the restarts a failure would have had."""

    attempts = asha_policy.AshaPolicy.attempts

    def no_extra_attempts(self: asha_policy.AshaPolicy, trial: FrozenTrial) -> Attempts:
        return replace(attempts(self, trial), extra=0)

    return _patched(asha_policy.AshaPolicy, "attempts", no_extra_attempts)


def _asha_keeps_one_too_many() -> contextlib.AbstractContextManager[None]:
    """ASHA's rung keeping one trial more than its top ``1 / reduction_factor``."""

    def kept(self: Asha, reached: int) -> int:
        return max(1, reached // self.reduction_factor) + 1 if reached else 0

    return _patched(Asha, "kept", kept)


def _asha_prunes_while_busy() -> contextlib.AbstractContextManager[None]:
    """ASHA's end of the study pruning the paused trials once a trial has completed, while the study's
    own trials still run (and could still put a paused one in the top)."""

    plan = asha_policy.AshaPolicy.plan

    def end_once_one_completed(self: asha_policy.AshaPolicy, view: SlotView) -> Plan:
        planned = plan(self, view)
        if view.room - planned.ask > 0 or not any(t.state is TrialState.COMPLETE for t in view.trials):
            return planned
        by_rule = tuple(n for n in planned.resume if n in self.asha.promotable(view.trials))
        paused = tuple(t.number for t in view.trials if is_paused(t) and t.number not in by_rule)
        return Plan(resume=by_rule, ask=planned.ask, end=paused)

    return _patched(asha_policy.AshaPolicy, "plan", end_once_one_completed)


def _parked_counted_in_flight() -> contextlib.AbstractContextManager[None]:
    def with_mine(self: tuner.Tuner, running: list[FrozenTrial], mine: set[int]) -> set[int]:
        return (mine | {t.number for t in running}) - set(self._abandoned)

    return _patched(tuner.Tuner, "_in_flight", with_mine)


def _asha_judges_untold_rung() -> contextlib.AbstractContextManager[None]:
    call = tuner.ReportFeed.__call__

    def judged_on_the_last_report(self: tuner.ReportFeed, reports: list[Any]) -> Any:
        real = self.judge
        if real is None or not reports:
            return call(self, reports)
        newest = max(r.step for r in reports)

        class OnTheLastReport:
            def judge(self, told: Told) -> str | None:
                assert real is not None
                return real.judge(replace(told, step=max(told.step, newest)))

        self.judge = OnTheLastReport()
        try:
            return call(self, reports)
        finally:
            self.judge = real

    return _patched(tuner.ReportFeed, "__call__", judged_on_the_last_report)


def _pbt_copies_its_own() -> contextlib.AbstractContextManager[None]:
    """PBT copying the exploited member's own newest checkpoint while it records the donor's."""

    def copy_from_a_donor(
        self: population.Population, exploited: FrozenTrial, donors: Any, trials: Any
    ) -> tuple[FrozenTrial, CheckpointInfo | None]:
        for member in donors:
            head = self.pbt.head(member, trials)
            copied = self._copy_newest(exploited, self.job_dir(exploited) / f"pbt-seed-from-{head.number}")
            if copied is not None:
                return head, copied
        own = self._copy_newest(exploited, self.job_dir(exploited) / f"pbt-seed-from-{exploited.number}")
        return exploited, own

    return _patched(population.Population, "_copy_from_a_donor", copy_from_a_donor)


def _pruned_step_fails_the_copy() -> contextlib.AbstractContextManager[None]:
    """PBT's copy of a donor's step retried only where the step was gone before its files were listed
    (``FileNotFoundError``): a ``shutil.Error`` of files the donor's job pruned under the copy is
    raised, as a failure of the copy's own."""
    return _patched(checkpoints, "_lost_to_a_prune", lambda failed: False)


def _parked_ended_beside_an_abandoned_trial() -> contextlib.AbstractContextManager[None]:
    """The policy's end of the study carried out while a trial this orchestrator gave up driving
    still runs."""
    return _patched(tuner.Tuner, "_may_end_parked", lambda self: True)


def _copies_into_one_folder_at_once() -> contextlib.AbstractContextManager[None]:
    """Copies into one folder no longer take turns: a second driver of the trial clears the first
    one's copy in progress."""
    return _patched(checkpoints, "_copying_into", lambda into_dir: contextlib.nullcontext(True))


def _threshold_bounds_swapped() -> contextlib.AbstractContextManager[None]:
    """The threshold pruner built with its bounds swapped: it prunes the trials that rise above
    ``lower`` instead of those that fall below it."""
    make = study.make_pruner

    def make_pruner(spec: PrunerSpec) -> optuna.pruners.BasePruner:
        if spec.kind != "threshold":
            return make(spec)
        lower, upper = spec.upper, spec.lower
        return optuna.pruners.ThresholdPruner(lower=lower, upper=upper, n_warmup_steps=spec.warmup_steps)

    return _patched(study, "make_pruner", make_pruner)


def _tracking_record_created_unlocked() -> contextlib.AbstractContextManager[None]:
    """A mirror writes the job dir's empty tracking record without the tracking lock: a stale
    mirror's late write puts it over the record that names the trial's run."""

    def create_record(self: RunMirror) -> None:
        if not JobPaths(self.job_dir).tracking.exists():
            self._save(run_requested=False)

    return _patched(RunMirror, "_create_record", create_record)


def _lost_ranks_beat_on() -> contextlib.AbstractContextManager[None]:
    def keep_every_beat(folder: Path, world_size: int) -> None:
        return None

    return _patched(progress, "forget_ranks_from", keep_every_beat)


def _restore_ignores_peers() -> contextlib.AbstractContextManager[None]:
    real = memory_store.choose_restore

    def own_node_only(
        nodes: dict[int, dict[int, memory_store.StepListing]], newest_shared: int | None
    ) -> memory_store.RestorePlan | None:
        own = min(nodes, default=None)
        return real({} if own is None else {own: nodes[own]}, newest_shared)

    return _patched(memory_store, "choose_restore", own_node_only)


def _restore_prefers_shared() -> contextlib.AbstractContextManager[None]:
    real = memory_store.choose_restore

    def shared_first(
        nodes: dict[int, dict[int, memory_store.StepListing]], newest_shared: int | None
    ) -> memory_store.RestorePlan | None:
        return real({} if newest_shared is not None else nodes, newest_shared)

    return _patched(memory_store, "choose_restore", shared_first)


def _last_reports_decide_nothing() -> contextlib.AbstractContextManager[None]:
    def fed_and_dropped(self: drive.JobDriver, stopping: Any) -> Any:
        self._feed_reports()
        return stopping

    return _patched(drive.JobDriver, "_stop_at_the_end", fed_and_dropped)


def _stopped_on_a_stale_state() -> contextlib.AbstractContextManager[None]:
    def always(self: drive.JobDriver, handle: Any) -> bool:
        return True

    return _patched(drive.JobDriver, "_still_running", always)


def _takeover_judges_nothing() -> contextlib.AbstractContextManager[None]:
    def first_look_skipped(self: tuner.ReportFeed, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._first_look = False

    init = tuner.ReportFeed.__init__
    return _patched(tuner.ReportFeed, "__init__", first_look_skipped)


def _requeue_before_takeover_unseen() -> contextlib.AbstractContextManager[None]:
    def only_when_seen(self: drive.JobDriver, handle: Any, *, seen_running: bool) -> None:
        if seen_running:
            queued_again(self, handle, seen_running=seen_running)

    queued_again = drive.JobDriver._queued_again
    return _patched(drive.JobDriver, "_queued_again", only_when_seen)


def _slurm_runs_unmarked() -> contextlib.AbstractContextManager[None]:
    return _patched(slurm_launcher.SlurmLauncher, "run_mark", lambda self, status: None)


MUTANTS = [
    Mutant("leases-leak", "issue 28, 2: leases of trials a failed ask never started stay held", _leases_leak),
    Mutant(
        "half-asked",
        "issue 28, 5: a trial a failed ask left behind is trained on defaults",
        _half_asked_trained,
    ),
    Mutant(
        "unfenced", "issue 28, 9: a driver whose lease was taken acts until its heartbeat notices", _unfenced
    ),
    Mutant(
        "host-clock",
        "issue 28, 8 and clock jumps: the watchdog trusts the driver's wall clock",
        _host_clock_trusted,
    ),
    Mutant(
        "purged-failed",
        "a job Slurm purged after it exited 0 is read as FAILED",
        _purged_is_failed,
        kinds=("slurm",),
    ),
    Mutant(
        "forgotten-intent",
        "a Slurm job that ran and was purged before its job id reached the record is submitted again",
        _forgotten_intent_sent_again,
        kinds=("slurm",),
    ),
    Mutant(
        "requeued-failed",
        "a Slurm job requeued after a node failure is read as FAILED",
        _requeued_is_failed,
        kinds=("slurm",),
    ),
    Mutant(
        "node-fail-cancelled",
        "a Slurm job that ended NODE_FAIL is read as cancelled, and not restarted",
        _node_fail_is_cancelled,
        kinds=("slurm",),
    ),
    Mutant(
        "left-behind-beats",
        "a rank that a Slurm node left behind, beating on after its job was requeued or restarted, "
        "is taken for the next run's and stops it as hung or timed out",
        _left_behind_beats_count,
        kinds=("slurm",),
    ),
    Mutant(
        "late-stop",
        "a job that finished before a decided stop reached it is counted as stopped",
        _decided_stop_wins,
    ),
    Mutant(
        "leftovers-ignored",
        "issue 28, 3: a local job whose wrapper exited counts as ended while its workers train on",
        _leftovers_ignored,
        kinds=("local",),
    ),
    Mutant(
        "ttl-failed",
        "a HyperPod EKS job whose TTL deleted its object after it exited 0 is read as FAILED",
        _ttl_deleted_is_failed,
        kinds=("hyperpod_eks",),
    ),
    Mutant(
        "gone-intent",
        "a HyperPod EKS job that ran and was TTL-deleted before its creation was recorded is created again",
        _gone_intent_sent_again,
        kinds=("hyperpod_eks",),
    ),
    Mutant(
        "stopped-upload",
        "SageMaker: a job a stop reached while it uploaded, after its script exited 0, counts as stopped",
        _stopped_upload_cancelled,
        kinds=("sagemaker",),
    ),
    Mutant(
        "wall-clock-timeout",
        "a job without heartbeats (SageMaker without writable FSx) times out on its driver's wall clock",
        _wall_clock_timeout,
    ),
    Mutant(
        "early-pause",
        "issue 30: an ASHA pause recorded when decided, while the trial's job still runs",
        _pause_recorded_at_the_decision,
    ),
    Mutant(
        "sent-intent-refused",
        "a submit retried after a lost create reply refuses its own attempt's job, or runs it again",
        _sent_intent_refused,
        kinds=("sagemaker",),
    ),
    Mutant(
        "continued-twice",
        "PBT: an exploited trial's continuation created without looking for one made before a crash",
        _continued_without_looking,
        # Every backend's seeds, though SageMaker's never run PBT: fewer kinds draw other scenarios.
        # Found by 10 of the first 1000 once the crashes just after a write came in; no seed of
        # 0-1160 finds it since the search-policy contract changed the loop's interleavings.
    ),
    Mutant(
        "train-step-leaks-lease",
        "a train step's job driver releases its lease only when the drive returns, not when it raises",
        _train_step_leaks_lease,
        kinds=("slurm", "hyperpod_eks", "local"),  # the seeds with steps
        # Found by seed 0 (a full disk under the train step's first submit).
    ),
    Mutant(
        "preempted-completed",
        "a job that saved and exited 0 on a preemption's stop signal is read as completed",
        _preempted_is_completed,
        # Found by seed 8 (a trial COMPLETE on a preemption's exit 0).
    ),
    Mutant(
        "startup-at-first-step",
        "the start-up timeout runs until a job's first step, not its first heartbeat",
        _started_at_first_step,
        # Found by seed 33 (a job 84 s starting up, stopped before its first step of a 88 s timeout).
    ),
    Mutant(
        "fence-check-before-lock",
        "a lease's fence checks the lease before it takes the lease lock: a stall between the two, past "
        "the TTL, and the old holder acts beside the new one",
        _fence_checked_before_lock,
    ),
    Mutant(
        "outbox-drops-readded",
        "the tracking outbox drops a mirror added again while its sync was under way: the newest records "
        "never reach MLflow",
        _readded_mirror_dropped,
    ),
    Mutant(
        "lease-handed-back",
        "a lease handed back to its owner's second caller, its fence re-entered by a second thread: a "
        "promotion starts a job while the paused trial's driver still records the pause",
        _lease_handed_back,
        # First found by seed 1087 (none of the first 1,000 seeds); since the draws changed with the
        # tuner's tally, the tracking record created under its lock and EKS restarts in place, by
        # 2822, hunted from 1808 on; since a mirror's sync is one MLflow write and the driver's fixes,
        # by 576. The short form replays it.
        found_by=576,
    ),
    Mutant(
        "no-marker-for-an-ended-job",
        "a stop decided on a job that had just ended leaves no cancel marker: after a crash a PBT exploit "
        "is read as a failure, the exploited trial restarted or told FAIL beside its continuation",
        # Found by seed 604 before the search-policy contract changed the loop's interleavings; no
        # seed of the first 1,000 finds it since. test_loop_findings.py's real SIGKILL still does.
        _no_marker_for_an_ended_job,
    ),
    Mutant(
        "torn-metrics-line",
        "the report reader takes a line still being written, or torn, for a whole one and passes it",
        _partial_line_consumed,
        # First found by seed 4 (a slow append read half written).
    ),
    Mutant(
        "torn-line-glued",
        "a report appended after a torn line of the metrics file is glued onto it",
        _glued_onto_torn_line,
        # First found by seed 10 (a crash mid-append, then the next run's report).
    ),
    Mutant(
        "sparse-telling",
        "Optuna told every step below 100 only, one in ten above (every step below 1,000 is told)",
        _dense_below_a_hundred,
        # First found by seed 6 (a program of 2,000 steps).
    ),
    Mutant(
        "last-step-untold",
        "a trial's last reported step is not told to Optuna as the trial ends",
        _last_step_untold,
        # First found by seed 22 (a last step off the grid of tens).
    ),
    Mutant(
        "objective-from-reports",
        "a trial's value is its last report's even where the job passed a final one to ctx.finish",
        _objective_from_reports,
        # First found by seed 0 (a result file).
    ),
    Mutant(
        "enqueued-again",
        "the spec's enqueued configurations are queued again by every run of the study",
        _enqueued_again,
        # First found by seed 0 (any rerun).
    ),
    Mutant(
        "enqueue-unlocked",
        "the spec's enqueued configurations are queued outside the study lock",
        _enqueued_unlocked,
        # First found by seed 14 (two orchestrators starting together).
    ),
    Mutant(
        "promotions-eat-restarts",
        "ASHA's promotions counted against max_restarts: a promoted trial fails with restarts unspent",
        _promotions_eat_restarts,
        # Found by 3 of the first 300 seeds (the first, 41) since ASHA's seeds crash more (1 before).
    ),
    Mutant(
        "asha-keeps-one-too-many",
        "ASHA's rungs keep one trial more than their top: trials go on, or are promoted, outside it",
        _asha_keeps_one_too_many,
    ),
    Mutant(
        "asha-prunes-while-busy",
        "ASHA's end of the study prunes the paused trials while the study's own trials still run",
        _asha_prunes_while_busy,
    ),
    Mutant(
        "parked-counted-in-flight",
        "an orchestrator counts its own trials in flight until their drivers return, parked ones too: "
        "one that looks at the study while the other drives takes a just-paused trial for the study's "
        "own work, and slots that would idle resume every paused trial",
        _parked_counted_in_flight,
        # First found by seed 821 (Slurm, ASHA: a paused trial promoted for an idle slot after a
        # trial completed), none of 0-820 does; since the tuner tallies the study instead of reading
        # every trial and the tracking record is created under its lock and EKS restarts in place
        # start a new run's clocks (other draws), by seed 994, found hunting from 755 on.
        found_by=81,
    ),
    Mutant(
        "asha-judges-untold-rung",
        "ASHA judges a job at the newest step reported rather than the newest told: past step 1,000 a "
        "rung is judged before Optuna holds the trial's value there, and the trial is paused as though "
        "outside the top",
        _asha_judges_untold_rung,
        found_by=605,
    ),
    Mutant(
        "pbt-wrong-donor",
        "PBT seeds a continuation with the exploited member's own checkpoint, recording the donor's",
        _pbt_copies_its_own,
    ),
    Mutant(
        "copy-fails-on-a-pruned-step",
        "PBT: a donor step its job pruned while it was copied fails the copy (only a step gone before "
        "the copy is retried)",
        _pruned_step_fails_the_copy,
        # First found by seed 76 (slow copies: the donor's job prunes step 0 under the copy); 13 of
        # the 43 seeds of the first 1,000 that draw slow copies found it then. Since the draws changed
        # (the tuner's tally, the tracking record under its lock, EKS restarts in place), seed 399.
    ),
    Mutant(
        "parked-ended-beside-abandoned",
        "ASHA's paused trials pruned at the end of the study while a trial whose driver failed still "
        "runs, before the run that re-attaches to it has its reports",
        _parked_ended_beside_an_abandoned_trial,
        # First found by seed 1161 (none of the first 1,000); since the tuner tallies the study
        # instead of reading every trial (other draws), by seed 1075, the first from 755 on; since the
        # tracking record is created under its lock and EKS restarts in place start a new run's
        # clocks (other draws again), by seed 2555, hunted from 1808 on (1807 finds it, but breaks
        # another invariant without it).
        found_by=88,
    ),
    Mutant(
        "copies-at-once",
        "two drivers of one trial copy a donor's step into one folder at once: each clears the other's "
        "copy in progress, which fails with its source intact",
        _copies_into_one_folder_at_once,
        # Found by seeds 207 and 507 (slow copies) as a defect of the library, fixed since; by seed
        # 1406 since the tuner tallies the study instead of reading every trial (other draws).
    ),
    Mutant(
        "threshold-swapped",
        "the threshold pruner built with lower and upper swapped: trials above the bound are pruned",
        _threshold_bounds_swapped,
    ),
    Mutant(
        "tracking-record-unlocked",
        "a mirror's empty tracking record written without the tracking lock: a stalled mirror's late "
        "write hides the trial's run, and a second run is created",
        _tracking_record_created_unlocked,
        # Found by seed 754 (with the tally's draws) as a defect of the library, fixed since; none of
        # the first 1,500 seeds before the tally finds it.
        found_by=754,
    ),
    Mutant(
        "lost-ranks-beat-on",
        "rank 0 of an elastic job's smaller group keeps the lost ranks' heartbeat files: their beats "
        "grow idle, and the watchdog stops the job as hung",
        _lost_ranks_beat_on,
        # Seeds are hunted over every backend (only Slurm's draw elastic jobs), so a found seed is
        # the one a plain --seeds run holds: seed 2537 (an elastic job stopped as hung).
        found_by=2537,
    ),
    Mutant(
        "restore-ignores-peers",
        "a memory-tier restore lists its own node's memory alone: a peer's replica of a newer step is "
        "passed over, and the steps since the shared one are trained again",
        _restore_ignores_peers,
        # Seed 1708: a job resumed after a node failure restores from a peer's replica.
        found_by=2354,
    ),
    Mutant(
        "restore-prefers-shared",
        "a memory-tier restore takes the shared file system's step whenever there is one, over a newer "
        "step complete in memory",
        _restore_prefers_shared,
        # Seed 120: the requeued job, and an elastic job's survivors, restore the older shared step.
        found_by=120,
    ),
    Mutant(
        "last-reports-decide-nothing",
        "a job's last reports, fed as it ended, decide no stop: a job that failed just after reaching a "
        "rung ASHA pauses it at is restarted and trains past it",
        _last_reports_decide_nothing,
        found_by=408,
    ),
    Mutant(
        "stopped-on-a-stale-state",
        "a job's time limit or hang is judged on the state read before the orchestrator was paused: a "
        "job that failed by itself meanwhile ends as timed out, its restarts unspent",
        _stopped_on_a_stale_state,
        found_by=1389,
    ),
    Mutant(
        "takeover-judges-nothing",
        "a driver that takes a trial over judges only values it tells: a rung value told by an "
        "orchestrator that died before judging it is never judged, and the job trains past the rung",
        _takeover_judges_nothing,
        found_by=628,
    ),
    Mutant(
        "requeue-before-takeover-unseen",
        "a job requeued before a driver took it over, queued at that driver's first look, is judged by "
        "the heartbeats of its run before: its next run is stopped as hung in its start-up",
        _requeue_before_takeover_unseen,
        found_by=2400,
    ),
    Mutant(
        "slurm-runs-unmarked",
        "a Slurm job's runs are not told apart by their start time: a requeue that no look saw leaves "
        "the next run judged by the clocks of the run before, and stopped as hung in its start-up",
        _slurm_runs_unmarked,
        kinds=("slurm",),
        found_by=2065,
    ),
]


def mutant(name: str) -> Mutant:
    found = [m for m in MUTANTS if m.name == name]
    if not found:
        raise SystemExit(f"no mutant {name!r}; the mutants: {', '.join(m.name for m in MUTANTS)}")
    return found[0]
