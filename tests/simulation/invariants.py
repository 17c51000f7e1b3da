"""The invariants of the tuning loop, checked while a seed runs and once it has settled.

Checked at the moment it happens (the backends, the stores and the scheduler call the referee):

- **one live job per trial**: a job is created, or starts to run, only while no other job of its
  trial's job dir is queued or running;
- **a finished trial never runs again**: no job is created for a trial Optuna holds as finished;
- **fenced actions**: every job created or stopped, and every trial outcome told to Optuna, comes
  from the process that holds the trial's lease at that moment, inside its fence (the lease lock held,
  the lease file naming that process);
- **no healthy job is cancelled**: a stop asked as ``timed_out`` comes after the job's run really ran
  that long; as ``hung``, after it really stopped progressing for the hang timeout, or once its first
  heartbeat came (or has not yet come) later than the start-up timeout after it started running; a
  stop without a reason in the job dir is a violation (the tuner never stops a job without one);
- **no lease held by a process that no longer acts**: when a driver call (``Tuner.run()``, a train
  or evaluate step's ``run_job``) returns or raises, and no other thread of its process is left but
  its lease heartbeat and tracking outbox (none that could drive a job), that heartbeat renews no
  lease that is still its job dir's current one. (A release whose write failed, on a full disk, is no
  leak: the heartbeat no longer renews it, and it expires with its TTL.) A process killed mid-call is
  not asked: its leases are taken over as a dead holder's;
- **a step's outcome is its job's** (train and evaluate steps): a step that returns a result has a
  run of its job that wrote it; a step that fails with a ``JobError`` (not a lost lease) has no run
  that finished, and did not fail on a preemption ``max_restarts`` still allowed to restart;
- **a rerun of a completed step starts no job**: no job is created in a step's job dir that held a
  result when a step began with it (the rerun reuses the result);
- **an exploited trial goes on once** (PBT, checked at the end): one continuation per trial an exploit
  ended, and that trial PRUNED;
- **a paused trial has no live job** (ASHA): a pause is recorded only once the trial's job has ended,
  and a promotion only written inside the trial's fence; no job is created for a trial recorded as
  paused (a promotion is written before its job is created).

Checked once every fault has stopped and the study has settled:

- **liveness**: the study ends (a ``tunepod run`` returns) within the scenario's ``settle_s``;
- **every trial ends counted once**: exactly ``num_trials`` finished trials, none left running or
  queued, each with every parameter of the space, each told its outcome once;
- **every trial ends with its job's outcome**: COMPLETE exactly when its last job exited 0 by itself;
  PRUNED only after a stop asked as pruned or paused (or a job that failed as the pruner decided);
- **every report reaches MLflow once**: one MLflow run per trial, ended as Optuna says, whose metric
  history is its metrics file whole line for whole line (same-step reports included), nothing else but
  the final objectives (each of a multi-objective study's) at the last step;
- **every report reaches Optuna**: each intermediate value is a value the trial reported at that step;
  Optuna holds each step the sparse rule picks of the trial's reports (every step below 1,000, then the
  first report in each run of steps sharing three significant digits: re-derived here apart from
  ``next_step_to_tell``) up to the last step it holds, and a COMPLETE trial's last reported step; a
  multi-objective trial holds none (nothing is told before its end);
- **every objective is told**: a COMPLETE trial holds one value per objective, its result file's
  (``ctx.finish``), else its last whole report's;
- **a torn line costs only itself**: every report the program appended whole is a whole line of its
  metrics file, once; a line torn by a run killed or crashed mid-append is no report to any reader (the
  referee's too), so with the two above no torn line reaches Optuna or MLflow as a value, and the
  whole lines after it do;
- **each enqueued configuration runs once, first**: it is the parameters of exactly one trial (a PBT
  continuation, which inherits its member's, aside), among the first ``len(enqueue)``, whatever the
  crashes and however many orchestrators start together;
- **a node failure costs only the steps since its last checkpoint** (Slurm): the run that follows a
  node failure in its trial's job dir (the requeued job's next run, or the next attempt's) resumes
  from the newest checkpoint saved when it starts, and that is no older than the newest one saved
  when the failure struck (no step trained again that was saved before it, none skipped); a job that
  ended NODE_FAIL (no result, stopped by no one but the watchdog for a hang) is started again while
  the trial's ``max_restarts`` allows, so its trial does not end FAIL on it. That the trial it hit is
  still one Optuna trial, told once, with one MLflow run, is "every trial ends counted once" above;
- **a preempted job resumes** (a stop signal its script saved on and exited 0 by, not tunepod's): the
  next run of its job dir resumes from the newest checkpoint, no older than the newest saved when it
  was preempted; its trial does not end FAIL on it while ``max_restarts`` allows a restart, nor
  COMPLETE on its exit 0 ("every trial ends with its job's outcome");
- nothing is left running: no job, no lease held by a live process, no simulated thread that died (a
  run orphaned by its node's failure is the cluster's to kill, not tunepod's).

Where a run orphaned by a node failure trains on and finishes unseen (its result written after its
job went on without it, or an exit 0 nobody heard), a trial may end COMPLETE or not: both are true.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from simulation.cluster import HEARTBEAT_S, Cluster, JobRun, NodeFailure
from simulation.scheduler import Process, Scheduler, State
from simulation.stores import MlflowTwin, OptunaDatabase
from tunepod.errors import JobError
from tunepod.hpo.asha import AshaState, is_paused
from tunepod.hpo.pbt import PbtState
from tunepod.hpo.trials import ATTR_JOB_DIR
from tunepod.hpo.tuner import ATTR_LAST_STEP
from tunepod.launch.lease import Lease, LeaseLost, LeaseRecord, _Heartbeat, read_lease
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_cancel_marker, read_submission

# A driver sees a state change at its next poll: a stop may come this much after the condition held.
_POLL_SLACK_S = 1.0
# Threads of an orchestrator that never drive a job: the lease heartbeat only renews what drivers hold.
_NOT_DRIVERS = ("tunepod-lease-heartbeat", "tunepod-tracking-outbox")
_HEARTBEAT = "tunepod.launch.lease.heartbeat"
_RUN_STATUS = {TrialState.COMPLETE: "FINISHED", TrialState.PRUNED: "KILLED", TrialState.FAIL: "FAILED"}


@dataclass(frozen=True)
class Violation:
    at: float
    invariant: str
    detail: str


@dataclass(frozen=True)
class StudyFacts:
    """What the referee must know of the study to judge it."""

    study: str
    jobs_dir: Path
    num_trials: int
    params: tuple[str, ...]
    metric: str
    timeout_s: float | None
    hang_timeout_s: float | None
    max_restarts: int = 0
    startup_timeout_s: float | None = None
    objectives: tuple[str, ...] = ()
    """The study's objectives' metrics, primary first (empty: ``metric`` alone)."""
    enqueue: tuple[dict[str, float], ...] = ()
    """The configurations the spec enqueues, in order."""

    @property
    def goals(self) -> tuple[str, ...]:
        return self.objectives or (self.metric,)


class Referee:
    """Collects violations; see the module docstring for what it checks and when."""

    def __init__(
        self,
        sim: Scheduler,
        cluster: Cluster,
        database: OptunaDatabase,
        mlflow: MlflowTwin,
        facts: StudyFacts,
    ) -> None:
        self.sim = sim
        self.cluster = cluster
        self.database = database
        self.mlflow = mlflow
        self.facts = facts
        self.violations: list[Violation] = []
        self._reused: set[Path] = set()
        """Step job dirs that held a result when a step began: no job is created there any more."""

    def violated(self, invariant: str, detail: str) -> None:
        self.violations.append(Violation(self.sim.now, invariant, detail))
        self.sim.trace.event(self.sim.now, "violation", f"{invariant}: {detail}")

    # ------------------------------------------------------------------------------ as it happens

    def job_created(self, job_dir: Path, live_job_ids: list[str]) -> None:
        self._fenced(job_dir, "creates a job")
        if live_job_ids:
            self.violated(
                "one live job per trial", f"a job is created for {job_dir.name} while {live_job_ids} live"
            )
        trial = self._trial_of(job_dir)
        if trial is not None and trial.state.is_finished():
            self.violated(
                "a finished trial never runs again",
                f"a job is created for {job_dir.name}, whose trial is {trial.state.name}",
            )
        if trial is not None and is_paused(trial):
            self.violated("a paused trial has no live job", f"a job is created for paused {job_dir.name}")
        # A run whose exit nobody could record (its local wrapper killed) may be started again: that is
        # recovery from lost knowledge, and the new run resumes from its last checkpoint.
        done = [
            run.job_id
            for run in self.cluster.runs
            if run.job_dir == job_dir and (_seen_finishing(run) or _exited_by_itself(run))
        ]
        if done:
            self.violated(
                "a finished trial never runs again",
                f"a job is created for {job_dir.name}, whose job {done[0]} finished its training (exit 0)",
            )
        if job_dir in self._reused:
            self.violated(
                "a rerun of a completed step starts no job",
                f"a job is created for {job_dir.parent.name} {job_dir.name}, whose result was there when "
                "the step began",
            )

    def job_started(self, job_dir: Path) -> None:
        live = self.cluster.live_runs(job_dir)
        if len(live) > 1:
            ids = [run.job_id for run in live]
            self.violated("one live job per trial", f"{job_dir.name} has jobs {ids} running at once")

    def stop_requested(self, job_dir: Path, job_id: str) -> None:
        self._fenced(job_dir, f"stops job {job_id}")
        self.cluster.stop_requested(job_dir, job_id)
        marker = read_cancel_marker(JobPaths(job_dir))
        reason = marker.reason if marker is not None else None
        runs = [run for run in self.cluster.live_runs(job_dir) if run.job_id == job_id]
        if reason in ("pruned", "paused", "exploited") or not runs:
            return
        run, now, facts = runs[0], self.sim.now, self.facts
        if reason == "timed_out":
            ran = now - run.started_at
            # The watchdog takes the ranks' word for it, which may run a heartbeat behind.
            if facts.timeout_s is None or ran + HEARTBEAT_S + _POLL_SLACK_S < facts.timeout_s:
                self.violated(
                    "no healthy job is cancelled",
                    f"job {job_id} of {job_dir.name} stopped as timed out after running {ran:.0f}s of "
                    f"its {facts.timeout_s}s",
                )
        elif reason == "hung":
            if not self._hung(run):
                idle = now - run.last_progress_at
                self.violated(
                    "no healthy job is cancelled",
                    f"job {job_id} of {job_dir.name} stopped as hung {idle:.0f}s after its last "
                    f"progress (hang timeout {facts.hang_timeout_s}s, start-up timeout "
                    f"{facts.startup_timeout_s}s, first heartbeat {_since(run.beating_at, run.started_at)})",
                )
        else:
            self.violated(
                "no healthy job is cancelled", f"job {job_id} of {job_dir.name} stopped for reason {reason!r}"
            )

    def _hung(self, run: JobRun) -> bool:
        """Whether a stop as hung is right: the run's loop stopped advancing for the hang timeout (or it
        is hung for good), or its first heartbeat came (or has not come) past the start-up timeout
        after it started running. The watchdog counts both from later (its first look, the last
        advance it read), so a stop may come later, never earlier."""
        facts, now = self.facts, self.sim.now
        startup_s = (run.beating_at if run.beating_at is not None else now) - run.started_at
        if facts.startup_timeout_s is not None and startup_s + _POLL_SLACK_S >= facts.startup_timeout_s:
            return True
        if run.beating_at is None:
            return False
        idle = now - run.last_progress_at
        return run.hung or (facts.hang_timeout_s is not None and idle + _POLL_SLACK_S >= facts.hang_timeout_s)

    def asha_state_written(self, trial_id: int, state: AshaState) -> None:
        frozen = self.database.storage.get_trial(trial_id)
        job_dir = self._job_dir(frozen)
        self._fenced(job_dir, f"{'pauses' if state.paused else 'promotes'} trial {frozen.number}")
        live = self.cluster.live_runs(job_dir)
        if state.paused and live:
            self.violated(
                "a paused trial has no live job",
                f"trial {frozen.number} is recorded paused while {[run.job_id for run in live]} live",
            )

    def told(self, trial_id: int, state: TrialState) -> None:
        frozen = self.database.storage.get_trial(trial_id)
        self._fenced(self._job_dir(frozen), f"tells trial {frozen.number} {state.name}")

    def step_job_dir(self, job_dir: Path) -> None:
        """A train or evaluate step begins with ``job_dir``: holding a result, it is reused, never run."""
        if JobPaths(job_dir).result.exists():
            self._reused.add(job_dir)

    def step_ended(self, job_dir: Path | None, error: Exception | None) -> None:
        """A train or evaluate step returned (``error`` None) or raised: its outcome is its job's. A
        result comes from a run that wrote it; a failure of the job (a ``JobError``, not a lost lease)
        from a job none of whose runs finished, and not from a preemption that ``max_restarts`` still
        allowed to restart."""
        if job_dir is None:
            return  # it failed before its job dir was known (an MLflow or filesystem error)
        runs = [run for run in self.cluster.runs if run.job_dir == job_dir]
        finished = any(_seen_finishing(run) for run in runs)
        where = f"{job_dir.parent.name} {job_dir.name}"
        if error is None and not finished:
            self.violated(
                "a step's outcome is its job's", f"{where} returned a result no run of its job wrote"
            )
        if error is None or not isinstance(error, JobError) or isinstance(error, LeaseLost):
            return
        if finished:
            self.violated("a step's outcome is its job's", f"{where} failed though its job finished: {error}")
        last = runs[-1] if runs else None
        if last is not None and last.preempted_at is not None and self._may_restart(job_dir, last.job_id):
            self.violated(
                "a preempted job resumes",
                f"{where} failed on job {last.job_id}'s preemption with max_restarts "
                f"{self.facts.max_restarts} not spent: {error}"[:400],
            )

    def driver_returned(self, process: Process, call: str) -> None:
        """See "no lease held by a process that no longer acts" in the module docstring: called in
        the thread whose driver call (``call``) just returned or raised."""
        me = self.sim.task
        drivers = [
            task
            for task in process.tasks
            if task is not me and task.state is not State.DONE and not task.name.startswith(_NOT_DRIVERS)
        ]
        if drivers or not process.alive:
            return
        for lease in _renewed_by(process):
            record = read_lease(JobPaths(lease.job_dir))
            if record is not None and not record.released and record.generation == lease.generation:
                self.violated(
                    "no lease held by a process that no longer acts",
                    f"{call} of {process} returned, no thread of it drives a job, and its heartbeat "
                    f"renews the lease of {lease.job_dir.parent.name}/{lease.job_dir.name} "
                    f"(generation {lease.generation})",
                )

    def _fenced(self, job_dir: Path, action: str) -> None:
        process = self.sim.process
        paths = JobPaths(job_dir)
        holder = self.sim.locks.held_by(paths.lease_lock)
        lease = read_lease(paths)
        if holder is process and lease is not None and not lease.released and lease.pid == process.pid:
            return
        who = f"lease of pid {lease.pid} (released: {lease.released})" if lease is not None else "no lease"
        self.violated(
            "fenced actions",
            f"{process} {action} for {job_dir.name} without holding its fence (lock held by {holder}, {who})",
        )

    # ------------------------------------------------------------------------------ once settled

    def settled(self) -> None:
        """The end-of-run checks (see the module docstring)."""
        storage = self.database.storage
        study_id = storage.get_study_id_from_name(self.facts.study)
        trials = storage.get_all_trials(study_id, deepcopy=False)
        self._counted_once(trials)
        self._enqueued_once(trials)
        for trial in trials:
            if trial.state.is_finished():
                self._true_outcome(trial)
                self._mirrored(trial)
                self._told_values(trial)
                self._told_steps(trial)
                self._told_objectives(trial)
                self._whole_lines_kept(trial)
        self._node_failures_recovered(trials)
        self._preemptions_recovered(trials)
        self._no_lease_held_by_a_live_process()
        live = [run for run in self.cluster.runs if run.ended_at is None and run.orphaned_at is None]
        if live:
            self.violated("nothing left running", f"job runs still live: {[run.job_id for run in live]}")

    def _counted_once(self, trials: list[FrozenTrial]) -> None:
        states = Counter(trial.state.name for trial in trials)
        finished = [trial for trial in trials if trial.state.is_finished()]
        # Under PBT each member is counted; each of its trials an exploit ended has one continuation.
        wanted = self.facts.num_trials + sum(PbtState.of(trial) is not None for trial in trials)
        if len(finished) != wanted or len(finished) != len(trials):
            self.violated(
                "every trial ends counted once",
                f"{len(finished)} finished of {wanted} wanted; states {dict(states)}",
            )
        self._continued_once(trials)
        for trial in finished:
            missing = set(self.facts.params) - set(trial.params)
            if missing:
                self.violated(
                    "every trial ends counted once", f"trial {trial.number} lacks params {sorted(missing)}"
                )
            tells = self.database.finished_by.get(trial._trial_id, [])
            if len(tells) != 1:
                self.violated(
                    "every trial ends counted once",
                    f"trial {trial.number} was told {len(tells)} times: {tells}",
                )

    def _no_lease_held_by_a_live_process(self) -> None:
        live = {task.process for task in self.sim.tasks if task.process.alive}
        for job_dir, lease in self._leases():
            holders = [process for process in live if not lease.released and _names(lease, process)]
            if holders:
                self.violated(
                    "nothing left running",
                    f"{holders[0]} still holds the lease of {job_dir.parent.name}/{job_dir.name}",
                )

    def _preemptions_recovered(self, trials: list[FrozenTrial]) -> None:
        """See "a preempted job resumes" in the module docstring (a step's failure is ``step_ended``'s)."""
        by_dir = {self._job_dir(trial): trial for trial in trials}
        for preempted in [run for run in self.cluster.runs if run.preempted_at is not None]:
            runs = [run for run in self.cluster.runs if run.job_dir == preempted.job_dir]
            at = preempted.preempted_at
            following = [
                run for run in runs if run is not preempted and at is not None and run.started_at >= at
            ]
            if following:
                self._resumed_after_preemption(preempted, following[0])
            trial = by_dir.get(preempted.job_dir)
            failed = trial is not None and trial.state is TrialState.FAIL
            if failed and runs[-1] is preempted and self._may_restart(preempted.job_dir, preempted.job_id):
                self.violated(
                    "a preempted job resumes",
                    f"trial {trial.number if trial else '?'} ends FAIL on job {preempted.job_id}'s "
                    f"preemption with max_restarts {self.facts.max_restarts} not spent",
                )

    def _resumed_after_preemption(self, preempted: JobRun, run: JobRun) -> None:
        if run.first_step is None:
            return  # killed before its program began
        saved = preempted.saved_when_preempted
        wanted = run.newest_saved + self.cluster.program.stride if run.newest_saved is not None else 0
        newest = run.newest_saved if run.newest_saved is not None else -1
        if run.first_step != wanted or (saved is not None and newest < saved):
            self.violated(
                "a preempted job resumes",
                f"job {run.job_id} of {run.job_dir.name} starts at step {run.first_step} after job "
                f"{preempted.job_id} was preempted with step {saved} saved (newest saved at its start: "
                f"{run.newest_saved})",
            )

    def _may_restart(self, job_dir: Path, job_id: str) -> bool:
        """Job ``job_id``, its job dir's current attempt, may be started again: no stop of tunepod's
        ended it, and ``max_restarts`` is not spent."""
        paths = JobPaths(job_dir)
        record = read_submission(paths)
        marker = read_cancel_marker(paths)
        stopped = marker is not None and marker.job_id in (job_id, "")
        return record is not None and not stopped and record.attempt - 1 < self.facts.max_restarts

    def _leases(self) -> list[tuple[Path, LeaseRecord]]:
        """Every job dir's lease record (trials' and steps')."""
        found = []
        for path in sorted(self.facts.jobs_dir.parent.glob("**/lease.json")):
            lease = read_lease(JobPaths(path.parent))
            if lease is not None:
                found.append((path.parent, lease))
        return found

    def _continued_once(self, trials: list[FrozenTrial]) -> None:
        """PBT: an exploited trial goes on in exactly one continuation of its member, and has ended
        PRUNED (whether its job was stopped as exploited or had already ended is ``_true_outcome``'s)."""
        by_number = {trial.number: trial for trial in trials}
        replaced = Counter(state.replaces for t in trials if (state := PbtState.of(t)) is not None)
        for number, count in replaced.items():
            exploited = by_number[number]
            if count != 1 or exploited.state is not TrialState.PRUNED:
                self.violated(
                    "an exploited trial goes on once",
                    f"trial {number} ({exploited.state.name}) has {count} continuations",
                )

    def _true_outcome(self, trial: FrozenTrial) -> None:
        """COMPLETE exactly when the trial's last job wrote its result file in the job dir (the
        contract's end of training, even when a kill came before its exit), or exited 0 by itself having
        written its objective where the orchestrator reads it (a job that writes elsewhere, as
        SageMaker's without a writable FSx, cannot complete a trial: nothing tells its value); PRUNED
        only after a stop asked as pruned, or for a job that failed as the pruner decided (the decision
        stands: no restart)."""
        job_dir = self._job_dir(trial)
        runs = [run for run in self.cluster.runs if run.job_dir == job_dir]
        last = runs[-1] if runs else None
        finished = any(_seen_finishing(run) for run in runs) or (
            last is not None and _exited_by_itself(last) and self._objective_seen(job_dir)
        )
        if not finished and any(_finished_unseen(run) for run in runs):
            # It exited 0 unseen (a FAIL is all anyone could say, a COMPLETE would be luck), or an
            # orphaned run finished where no one could be sure to see it (both are true).
            return
        pruned = any(
            stop.reason in ("pruned", "paused", "exploited")
            for stop in self.cluster.stops
            if stop.job_dir == job_dir
        )
        # Ended unfinished by itself (a crash, or a preemption's exit 0) after the pruner decided.
        failed_alone = bool(runs) and (
            runs[-1].exit_code not in (0, None) or runs[-1].preempted_at is not None
        )
        wrong = (trial.state is TrialState.COMPLETE) != finished or (
            trial.state is TrialState.PRUNED and not (pruned or failed_alone)
        )
        if wrong:
            codes = [run.exit_code for run in runs]
            self.violated(
                "every trial ends with its job's outcome",
                f"trial {trial.number} is {trial.state.name}; its job runs' exit codes {codes}, "
                f"pruned: {pruned}",
            )

    def _node_failures_recovered(self, trials: list[FrozenTrial]) -> None:
        """See "a node failure costs only the steps since its last checkpoint" in the module docstring."""
        by_dir = {self._job_dir(trial): trial for trial in trials}
        for failure in self.cluster.node_failures:
            if failure.decided_at is None:
                continue  # the job was stopped, or it ended, before Slurm decided on it
            runs = [run for run in self.cluster.runs if run.job_dir == failure.job_dir]
            following = [run for run in runs if run.started_at >= failure.decided_at]
            self._resumed(failure, following[0] if following else None)
            trial = by_dir.get(failure.job_dir)
            last = bool(runs) and runs[-1].job_id == failure.job_id
            failed = trial is not None and trial.state is TrialState.FAIL
            if failure.outcome == "NODE_FAIL" and failed and last and self._restart_allowed(failure):
                self.violated(
                    "a node failure costs only the steps since its last checkpoint",
                    f"trial {trial.number if trial else '?'} ends FAIL on job {failure.job_id}'s NODE_FAIL "
                    f"with max_restarts {self.facts.max_restarts} not spent",
                )

    def _resumed(self, failure: NodeFailure, run: JobRun | None) -> None:
        if run is None or run.first_step is None:
            return  # no run followed (the trial ended), or it was killed before its program began
        name = failure.job_dir.name
        stride = self.cluster.program.stride
        wanted = run.newest_saved + stride if run.newest_saved is not None else run.first_step
        if run.first_step != wanted:
            self.violated(
                "a node failure costs only the steps since its last checkpoint",
                f"job {run.job_id} of {name} resumes at step {run.first_step} after a node failure, "
                f"the newest checkpoint being step {run.newest_saved}",
            )
        elif failure.saved is not None and (run.newest_saved is None or run.newest_saved < failure.saved):
            self.violated(
                "a node failure costs only the steps since its last checkpoint",
                f"job {run.job_id} of {name} resumes at step {run.first_step} after a node failure "
                f"struck job {failure.job_id} with step {failure.saved} saved",
            )

    def _restart_allowed(self, failure: NodeFailure) -> bool:
        """The job ended NODE_FAIL on its own (no stop but a hang's was asked) with restarts left, and
        is still its job dir's last attempt (a restart that never ran, and ended otherwise, is not)."""
        paths = JobPaths(failure.job_dir)
        record = read_submission(paths)
        marker = read_cancel_marker(paths)
        stopped = marker is not None and marker.job_id in (failure.job_id, "") and marker.reason != "hung"
        if record is None or stopped or record.job_id not in (None, failure.job_id):
            return False
        return record.attempt - 1 < self.facts.max_restarts

    def _mirrored(self, trial: FrozenTrial) -> None:
        key = f"{self.facts.study}/trial-{trial.number}"
        runs = self.mlflow.runs_with_key(key)
        if len(runs) != 1:
            self.violated(
                "every report reaches MLflow once", f"trial {trial.number} has {len(runs)} MLflow runs"
            )
            return
        run = runs[0]
        wanted = _RUN_STATUS[trial.state]
        if run.status != wanted:
            self.violated(
                "every report reaches MLflow once",
                f"trial {trial.number} is {trial.state.name} in Optuna and {run.status} in MLflow",
            )
        reported = Counter(_reported_points(JobPaths(self._job_dir(trial)).metrics))
        logged = Counter(
            (key, value, step) for key, points in run.metrics.items() for value, step, _ in points
        )
        extra = logged - reported
        if trial.state is TrialState.COMPLETE and trial.values:
            last = max(trial.intermediate_values, default=_last_step_attr(trial))
            extra -= Counter(
                (metric, value, last) for metric, value in zip(self.facts.goals, trial.values, strict=False)
            )
        # What an orphaned run reported once its job had gone on without it may come too late for anyone.
        missing = reported - logged - Counter(self.cluster.late_reports.get(self._job_dir(trial), []))
        if missing or extra:
            self.violated(
                "every report reaches MLflow once",
                f"trial {trial.number}: not in MLflow {sorted(missing)[:5]}, in MLflow but not reported "
                f"once {sorted(extra)[:5]}",
            )

    def _told_values(self, trial: FrozenTrial) -> None:
        reported = {
            (step, value)
            for key, value, step in _reported_points(JobPaths(self._job_dir(trial)).metrics)
            if key == self.facts.metric
        }
        for step, value in trial.intermediate_values.items():
            if (step, value) not in reported:
                self.violated(
                    "every report reaches Optuna",
                    f"trial {trial.number} was told {value} at step {step}, never reported",
                )

    def _told_steps(self, trial: FrozenTrial) -> None:
        """Optuna holds the steps ``_steps_told_by_rule`` picks of the trial's reports, up to the last
        step it holds, and a COMPLETE trial's last step; a multi-objective trial holds none."""
        held = trial.intermediate_values
        if len(self.facts.goals) > 1:
            if held:
                self.violated(
                    "every report reaches Optuna",
                    f"trial {trial.number} of a multi-objective study holds steps {sorted(held)[:5]}",
                )
            return
        job_dir = self._job_dir(trial)
        steps = [s for key, _, s in _reported_points(JobPaths(job_dir).metrics) if key == self.facts.metric]
        last_held = max(held, default=-1)
        skipped = [step for step in _steps_told_by_rule(steps) if step <= last_held and step not in held]
        if skipped:
            self.violated(
                "every report reaches Optuna",
                f"trial {trial.number} was never told steps {skipped[:5]} (it holds up to {last_held})",
            )
        complete = trial.state is TrialState.COMPLETE and self._reports_settled(job_dir)
        if complete and steps and last_held != max(steps):
            self.violated(
                "every report reaches Optuna",
                f"COMPLETE trial {trial.number}'s last step told is {last_held}, "
                f"its last report's {max(steps)}",
            )

    def _told_objectives(self, trial: FrozenTrial) -> None:
        """A COMPLETE trial is told every objective: the result file's value where there is one, else
        its last report's."""
        if trial.state is not TrialState.COMPLETE:
            return
        values = trial.values or []
        if len(values) != len(self.facts.goals):
            self.violated(
                "every objective is told",
                f"trial {trial.number} holds {len(values)} values for {self.facts.goals}",
            )
            return
        job_dir = self._job_dir(trial)
        if not self._reports_settled(job_dir):
            return
        wanted = _objective_values(JobPaths(job_dir))
        wrong = [
            f"{metric} {value} (wanted {wanted[metric]})"
            for metric, value in zip(self.facts.goals, values, strict=True)
            if metric in wanted and value != wanted[metric]
        ]
        if wrong:
            self.violated("every objective is told", f"trial {trial.number} was told {', '.join(wrong)}")

    def _whole_lines_kept(self, trial: FrozenTrial) -> None:
        """Every report the program appended whole is a whole line of its metrics file, once: a torn
        line (a run killed mid-append) costs only its own report."""
        job_dir = self._job_dir(trial)
        written = Counter(self.cluster.appended.get(job_dir, []))
        found = Counter(_reported_points(JobPaths(job_dir).metrics))
        if written != found:
            self.violated(
                "a torn line costs only itself",
                f"trial {trial.number}: appended whole but not found {sorted(written - found)[:3]}, found "
                f"but not appended whole {sorted(found - written)[:3]}",
            )

    def _enqueued_once(self, trials: list[FrozenTrial]) -> None:
        """Each enqueued configuration is the parameters of exactly one trial (a PBT continuation
        aside: it inherits its member's), among the first ``len(enqueue)``."""
        first = len(self.facts.enqueue)
        for params in self.facts.enqueue:
            ran = [
                trial.number
                for trial in trials
                if PbtState.of(trial) is None and all(trial.params.get(k) == v for k, v in params.items())
            ]
            if len(ran) != 1 or ran[0] >= first:
                self.violated(
                    "each enqueued configuration runs once, first",
                    f"{params} is the parameters of trials {ran} (of the first {first} wanted)",
                )

    def _reports_settled(self, job_dir: Path) -> bool:
        """Nothing came to the job dir after its trial could have read it: no report from an orphaned
        run, no training finished unseen."""
        runs = [run for run in self.cluster.runs if run.job_dir == job_dir]
        return not self.cluster.late_reports.get(job_dir) and not any(_finished_unseen(run) for run in runs)

    # ------------------------------------------------------------------------------ helpers

    def _trial_of(self, job_dir: Path) -> FrozenTrial | None:
        storage = self.database.storage
        try:
            study_id = storage.get_study_id_from_name(self.facts.study)
        except KeyError:
            return None
        for trial in storage.get_all_trials(study_id, deepcopy=False):
            if self._job_dir(trial) == job_dir:
                return trial
        return None

    def _objective_seen(self, job_dir: Path) -> bool:
        paths = JobPaths(job_dir)
        reported = any(key == self.facts.metric for key, _, _ in _reported_points(paths.metrics))
        return reported or paths.result.exists()

    def _job_dir(self, trial: FrozenTrial) -> Path:
        return Path(str(trial.user_attrs.get(ATTR_JOB_DIR, self.facts.jobs_dir / f"trial-{trial.number}")))


def _exited_by_itself(run: JobRun) -> bool:
    """It exited 0, heard, and not on a stop signal (a preempted script saves and exits 0 too)."""
    return run.exit_code == 0 and not run.exit_unrecorded and run.preempted_at is None


def _renewed_by(process: Process) -> list[Lease]:
    """The leases ``process``'s lease heartbeat renews (``tunepod.launch.lease``'s, per process)."""
    heartbeat = process.locals.get(_HEARTBEAT)
    if not isinstance(heartbeat, _Heartbeat):
        return []
    return [lease for lease in heartbeat._leases if not lease.lost]


def _names(lease: LeaseRecord, process: Process) -> bool:
    return (lease.host, lease.pid, lease.pid_start_ticks) == (
        process.host.name,
        process.pid,
        process.start_ticks,
    )


def _since(at: float | None, start: float) -> str:
    return "never" if at is None else f"{at - start:.0f}s after it started"


def _seen_finishing(run: JobRun) -> bool:
    """It wrote its result file while it was still its job's run (its backend's to report)."""
    return run.wrote_result and (
        run.orphaned_at is None or (run.result_at is not None and run.result_at <= run.orphaned_at)
    )


def _finished_unseen(run: JobRun) -> bool:
    """An orphaned run that finished its training once its job had gone on without it, or a run whose
    exit 0 nobody heard."""
    return (run.wrote_result and not _seen_finishing(run)) or (run.exit_unrecorded and run.exit_code == 0)


def _reported_points(metrics: Path) -> list[tuple[str, float, int]]:
    """Every (metric, value, step) of the metrics file's whole lines, in the order written. A line
    that is no whole report (torn: its writer was killed mid-append, and the next append began on a
    new line) is skipped, as the contract says readers skip it."""
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return []
    points = []
    for line in lines:
        report = _whole_report(line)
        if report is not None:
            points += [(key, float(value), int(report["step"])) for key, value in report["metrics"].items()]
    return points


def _whole_report(line: str) -> dict[str, Any] | None:
    try:
        report = json.loads(line)
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _steps_told_by_rule(steps: list[int]) -> list[int]:
    """Of a trial's reports of its objective at ``steps`` (in the order written), the steps Optuna
    must hold: each first report past every step told before (a resumed job reports some again) that
    reaches a new *cell*: each step below 1,000 is one, then the steps that share their first three
    digits (1,000 to 1,009, 1,010 to 1,019... 10,000 to 10,099...). Re-derived here apart from
    ``tunepod.hpo.tuner.next_step_to_tell``; a step told beyond these (the last one of a cell, told as
    a trial ends, pauses or is exploited) is allowed."""
    told, picked = -1, []
    for step in steps:
        if step > told and _cell(step) > _cell(told):
            picked.append(step)
            told = step
    return picked


def _cell(step: int) -> int:
    """The first step of ``step``'s cell (``_steps_told_by_rule``); -1 for none told."""
    if step < 1000:
        return step
    spacing = int(10 ** (len(str(step)) - 3))
    return step // spacing * spacing


def _last_step_attr(trial: FrozenTrial) -> int:
    """Where a trial's final objectives land when Optuna holds no intermediate value: the last step
    recorded at its end (a multi-objective study's), else ``_first_step``."""
    step = trial.user_attrs.get(ATTR_LAST_STEP)
    return int(step) if step is not None else _first_step(trial)


def _objective_values(paths: JobPaths) -> dict[str, float]:
    """What the trial's values must be: its result file's metrics, and for the metrics it lacks (no
    result file), the last whole report of each."""
    values: dict[str, float] = {}
    for key, value, _ in _reported_points(paths.metrics):
        values[key] = value
    try:
        result = json.loads(paths.result.read_text())
    except FileNotFoundError:
        return values
    return values | {key: float(value) for key, value in result["metrics"].items()}


def _first_step(trial: FrozenTrial) -> int:
    """Where a trial's final objective lands when it reported nothing: step 0, or for a PBT
    continuation the step of its donor's checkpoint."""
    state = PbtState.of(trial)
    return state.from_step if state is not None and state.from_step >= 0 else 0
