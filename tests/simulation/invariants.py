"""The invariants of the tuning loop, checked while a seed runs and once it has settled.

Checked at the moment it happens (the backends, the stores and the scheduler call the referee):

- **one live job per trial**: a job is created, or starts to run, only while no other job of its
  trial's job dir is queued or running;
- **a finished trial never runs again**: no job is created for a trial Optuna holds as finished;
- **fenced actions**: every job created or stopped, and every trial outcome told to Optuna, comes
  from the process that holds the trial's lease at that moment, inside its fence (the lease lock held,
  the lease file naming that process);
- **a pruner prunes by its rule** (the threshold pruner): a stop asked as ``pruned`` comes only when
  the trial's last value told to Optuna lies outside the pruner's bounds;
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
- **a checkpoint copy fails only on a full disk** (PBT): a copy never raises while files it failed
  on are gone from its source (a step its donor's job pruned under the copy, a save between two of
  its files, is a step gone, not a broken copy: the copy must take the donor's then newest step
  instead), nor while another copy into the same folder runs (two drivers of one trial, a stale one
  beside its lease's new holder, each clear the folder's hidden copies first). Raised, either fails
  the exploited trial's driver and the tune step, and the member waits RUNNING without its
  continuation until a later run. Checked as the copy raises;
- **a rerun of a completed step starts no job**: no job is created in a step's job dir that held a
  result when a step began with it (the rerun reuses the result);
- **an exploited trial goes on once** (PBT, checked at the end): one continuation per trial an exploit
  ended, and that trial PRUNED;
- **a paused trial has no live job** (ASHA): a pause is recorded only once the trial's job has ended,
  and a promotion only written inside the trial's fence; no job is created for a trial recorded as
  paused (a promotion is written before its job is created);
- **ASHA decides by its rule** (its end of the study): a promotion for a slot that would idle comes
  only once every trial was asked for; a paused trial is pruned only then, once a trial has
  completed, and while none of the study's own work runs (a trial resumed for an idle slot is not).

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
  from the newest step complete when it starts where its ranks can read it (with checkpoint tiers:
  the shared file system, or the memory of a node of its allocation, its own or a peer's replica,
  that answers; a node that stopped answering comes back with its memory gone), and that is no older
  than the newest one saved on the shared file system when the failure struck (no step trained again
  that was saved before it, none skipped); a job that
  ended NODE_FAIL (no result, stopped by no one but the watchdog for a hang) is started again while
  the trial's ``max_restarts`` allows, so its trial does not end FAIL on it. That the trial it hit is
  still one Optuna trial, told once, with one MLflow run, is "every trial ends counted once" above;
- **an elastic job loses a node, not its steps** (Slurm, ``resources.min_nodes``): when a node of an
  elastic job that is not its first is lost (killed, cut off, or its slurmd dead until its
  namespaces end) while at least ``min_nodes`` remain, the job runs on under its job id (no requeue,
  no NODE_FAIL) and its surviving ranks re-form: they resume from the newest step complete, when they
  restore, in the memory of a node left in the group or on the shared file system, which is no
  older than the newest one there when the node was lost (no step trained twice beyond it, none
  skipped); the watchdog never stops such a job as hung because the lost ranks stopped beating
  (checked at the stop: a stop as hung of a job that lost ranks comes only once its surviving ranks
  really stopped progressing for the hang timeout); and the trial's one MLflow run records each
  world the job ran in (the metric ``tunepod.world_size`` at the step each started from). That the
  trial is one Optuna trial, told once, with one MLflow run, is "every trial ends counted once" and
  "every report reaches MLflow once" above;
- **a preempted job resumes** (a stop signal its script saved on and exited 0 by, not tunepod's): the
  next run of its job dir resumes from the newest checkpoint, no older than the newest saved when it
  was preempted; its trial does not end FAIL on it while ``max_restarts`` allows a restart, nor
  COMPLETE on its exit 0 ("every trial ends with its job's outcome");
- **a trial fails only once its restarts are spent**: a trial whose last attempt failed by itself (its
  program exited non-zero, its node failed, or it hung) ends FAIL only after ``1 + max_restarts +
  promotions`` attempts (an ASHA promotion is an attempt that is no restart; a job lost with its node
  before it started is an attempt too), and no trial runs more attempts than that;
- **ASHA decides by its rule**: every pause, every rung a job went on past, and every promotion by the
  rule agrees with the referee's own successive-halving rule on the values Optuna held at some
  moment the decision could have been made (``simulation.decisions`` says which moments, and why);
- **a continuation resumes from its donor** (PBT): a continuation's first run resumes from a
  checkpoint trained by the donor its lineage records (or by that donor's own donor, when the donor
  started from that very step), at the recorded step, with the donor's parameters; each simulated
  checkpoint says which trial trained it, at which step, with which parameters;
- nothing is left running: no job, no lease held by a live process, no simulated thread that died (a
  run orphaned by its node's failure is the cluster's to kill, not tunepod's).

Where a run orphaned by a node failure trains on and finishes unseen (its result written after its
job went on without it, or an exit 0 nobody heard), a trial may end COMPLETE or not: both are true.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from simulation.cluster import HEARTBEAT_S, Cluster, JobRun, NodeFailure
from simulation.decisions import HalvingRule, ToldLog, asha_verdicts
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
from tunepod.runtime.worlds import read_worlds
from tunepod.spec.models import PrunerSpec
from tunepod.tracking import tags

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

    pruner: PrunerSpec | None = None
    """The study's pruner (ASHA's rungs); the study maximizes its metric."""


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
        pruner = facts.pruner
        self.halving = HalvingRule.of(pruner) if pruner is not None and pruner.kind == "asha" else None
        self.told_log = ToldLog()
        """Every intermediate value as it reached Optuna (what ASHA's decisions are judged on)."""
        self.asha_writes: dict[int, list[tuple[int, AshaState]]] = {}
        """Per trial number, each ASHA state written, at its moment of ``told_log``."""
        self._trial_ended_at = -math.inf
        """When a trial was last told finished or paused (simulated seconds)."""
        self._listen_to_reports()

    def _listen_to_reports(self) -> None:
        """Log each intermediate value as the database stores it, whoever tells it (as the
        database's hooks call the referee for tells and ASHA states)."""
        storage = self.database.storage
        store = storage.set_trial_intermediate_value

        def stored(trial_id: int, step: int, intermediate_value: float) -> None:
            store(trial_id, step, intermediate_value)
            number = storage.get_trial_number_from_id(trial_id)
            self.told_log.add(self.sim.now, self.sim.process.name, number, step, intermediate_value)

        storage.set_trial_intermediate_value = stored  # type: ignore[method-assign]

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
        if reason == "pruned":
            self._pruned_by_threshold(job_dir, job_id)
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
                    "an elastic job loses a node, not its steps"
                    if run.lost
                    else "no healthy job is cancelled",
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
        after its job started running. The watchdog counts both from later (its first look, the last
        advance it read), so a stop may come later, never earlier. The start-up is the job's: a run
        the backend started again in place (HyperPod's operator restarting a pod, a requeue no driver
        saw) is still the job running, and no heartbeat came in all that time."""
        facts, now = self.facts, self.sim.now
        job_started = (
            min(
                other.started_at
                for other in self.cluster.runs
                if other.job_dir == run.job_dir and other.job_id == run.job_id and other.beating_at is None
            )
            if run.beating_at is None
            else run.started_at
        )
        startup_s = (run.beating_at if run.beating_at is not None else now) - job_started
        if facts.startup_timeout_s is not None and startup_s + _POLL_SLACK_S >= facts.startup_timeout_s:
            return True
        if run.beating_at is None:
            return False
        idle = now - run.last_progress_at
        return run.hung or (facts.hang_timeout_s is not None and idle + _POLL_SLACK_S >= facts.hang_timeout_s)

    def _pruned_by_threshold(self, job_dir: Path, job_id: str) -> None:
        """The threshold pruner stops a trial only when the value it was last told lies outside
        ``[lower, upper]`` (the stop carries out that decision: nothing is told in between)."""
        pruner, trial = self.facts.pruner, self._trial_of(job_dir)
        if pruner is None or pruner.kind != "threshold" or trial is None:
            return
        steps = [step for step in trial.intermediate_values if step >= pruner.warmup_steps]
        last = trial.intermediate_values[max(steps)] if steps else None
        below = last is not None and pruner.lower is not None and last < pruner.lower
        above = last is not None and pruner.upper is not None and last > pruner.upper
        if not (below or above):
            self.violated(
                "a pruner prunes by its rule",
                f"job {job_id} of {job_dir.name} is stopped as pruned by the threshold pruner "
                f"[{pruner.lower}, {pruner.upper}] at value {last}",
            )

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
        self.asha_writes.setdefault(frozen.number, []).append((self.told_log.seq, state))
        if state.paused:
            self._trial_ended_at = self.sim.now
        if not state.paused and state.idle and not self._all_asked():
            self.violated(
                "ASHA decides by its rule",
                f"trial {frozen.number} is promoted for an idle slot while trials are still to ask for",
            )
        if not state.paused and state.idle and not self._idle_slots_may_resume(frozen.number):
            self.violated(
                "ASHA decides by its rule",
                f"trial {frozen.number} is promoted for an idle slot while a trial has completed and "
                "nothing of the study's own work runs (the paused trials were to end PRUNED)",
            )

    def told(self, trial_id: int, state: TrialState) -> None:
        self._trial_ended_at = self.sim.now
        frozen = self.database.storage.get_trial(trial_id)
        self._fenced(self._job_dir(frozen), f"tells trial {frozen.number} {state.name}")
        asha = AshaState.of(frozen)
        if state is TrialState.PRUNED and asha is not None and asha.paused:
            self._pruned_paused(frozen)

    def _pruned_paused(self, frozen: FrozenTrial) -> None:
        """ASHA's end of the study: a paused trial ends PRUNED only once every trial was asked for,
        one has completed (until then, a slot that would idle resumes the best paused trial) and none
        of the study's own work runs (a trial resumed for an idle slot is not: ``AshaState.idle``)."""
        trials = self._trials()
        if not self._all_asked() or not any(t.state is TrialState.COMPLETE for t in trials):
            states = dict(Counter(t.state.name for t in trials))
            self.violated(
                "ASHA decides by its rule",
                f"paused trial {frozen.number} is pruned at the end of the study with trials {states}",
            )
        busy = self._running_since(frozen, trials)
        if busy:
            self.violated(
                "ASHA decides by its rule",
                f"paused trial {frozen.number} is pruned at the end of the study while trials {busy} run",
            )

    def _running_since(self, paused: FrozenTrial, trials: list[FrozenTrial]) -> list[int]:
        """The trials of the study's own work that have run since ``paused`` was paused: the decision
        to prune it, made after that, saw them. One never paused has run since it was asked (every
        trial was asked before the decision); one promoted by the rule since its promotion (one that
        another orchestrator promoted after the decision is passed). A trial no live thread drives is
        passed too: an orchestrator leaves out the trials it gave up driving (their jobs run on, to be
        re-attached to by a later run), and so prunes beside them."""
        pauses = [at for at, state in self.asha_writes.get(paused.number, []) if state.paused]
        running = []
        for trial in trials:
            state = AshaState.of(trial)
            if trial.state is not TrialState.RUNNING or ATTR_JOB_DIR not in trial.user_attrs:
                continue  # finished, or half asked (nothing runs)
            if state is not None and (state.paused or state.idle):
                continue
            if not self._driven(trial.number):
                continue
            promoted = [at for at, written in self.asha_writes.get(trial.number, []) if not written.paused]
            if not promoted or (pauses and promoted[-1] < pauses[-1]):
                running.append(trial.number)
        return running

    def _idle_slots_may_resume(self, number: int) -> bool:
        """ASHA resumes a paused trial for a slot that would idle only before any trial completed, or
        while some of the study's own work runs: a trial RUNNING, not paused, and not itself resumed
        for an idle slot (whichever orchestrator drives it). Decided on the study as it stood when
        the study lock was taken: a trial that ended or paused since may have been that work."""
        since = self.sim.locks.held_since(self.facts.jobs_dir / ".study.lock")
        if since is not None and self._trial_ended_at >= since:
            return True
        trials = [t for t in self._trials() if t.number != number]
        if not any(t.state is TrialState.COMPLETE for t in trials):
            return True
        return any(t.state is TrialState.RUNNING and not _paused_or_idle(t) for t in trials)

    def _all_asked(self) -> bool:
        return len(self._trials()) >= self.facts.num_trials

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
        # A run its node's failure orphaned may train on and write its result unseen: then both are true.
        if error is None and not finished and not any(_finished_unseen(run) for run in runs):
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

    def copy_failed(self, failed: shutil.Error) -> None:
        """A checkpoint copy (``copy_newest_checkpoint``) raised ``failed``: see "a checkpoint copy
        fails only on a full disk" in the module docstring. Called as it raises, before any yield
        point, so that what is gone from the source is what was gone when the copy failed."""
        entries = failed.args[0] if failed.args and isinstance(failed.args[0], list) else []
        pruned = [str(entry[0]) for entry in entries if not os.path.lexists(entry[0])]
        unexplained = [
            entry for entry in entries if os.path.lexists(entry[0]) and "No space left" not in entry[2]
        ]
        if pruned:
            # The sources only: the copy's hidden folder has a random name, which a replay would not share.
            gone = [path.replace(str(self.facts.jobs_dir), "<jobs>") for path in pruned]
            self.violated(
                "a checkpoint copy fails only on a full disk",
                f"a copy raised on {len(entries)} file(s), of which its source's job had pruned "
                f"{len(gone)} under it: {', '.join(gone)}"[:400],
            )
        elif unexplained or not entries:
            # The cause without its paths: the copy's hidden folder has a random name.
            why = str(unexplained[0][2]).split(":")[0] if unexplained else type(failed).__name__
            self.violated(
                "a checkpoint copy fails only on a full disk",
                f"a copy raised with its source intact, on no full disk ({len(unexplained)} file(s)): {why}",
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
                self._restarts_spent(trial)
            self._asha_decided(trial)
        self._node_failures_recovered(trials)
        self._group_losses_recovered()
        self._preemptions_recovered(trials)
        self._continued_from_donors(trials)
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
        # Ended unfinished by itself (a crash, a preemption's exit 0, or its node failing under it, which
        # a re-attaching orchestrator meets as a NODE_FAIL) after the pruner decided.
        failed_alone = bool(runs) and (
            runs[-1].exit_code not in (0, None)
            or runs[-1].preempted_at is not None
            or runs[-1].orphaned_at is not None
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

    def _group_losses_recovered(self) -> None:
        """See "an elastic job loses a node, not its steps" in the module docstring."""
        for loss in self.cluster.group_losses:
            if loss.restored_at is None:
                continue  # the run ended (or was stopped) before its group re-formed
            newest, resumed = loss.newest_at_restore, loss.resumed
            older = loss.newest is not None and (resumed is None or resumed < loss.newest)
            if resumed != newest or older:
                self.violated(
                    "an elastic job loses a node, not its steps",
                    f"job {loss.job_id} of {loss.job_dir.name} lost {loss.node} with step {loss.newest} "
                    f"complete on the nodes left, and its survivors restored step {resumed} (newest "
                    f"complete then: {newest})",
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

    def _restarts_spent(self, trial: FrozenTrial) -> None:
        """A trial whose last attempt failed by itself (its program exited non-zero, its node failed, or
        it hung) ends FAIL only after 1 + max_restarts + promotions attempts: each ASHA promotion is an
        attempt that is no restart. The attempts are the submission record's count, not the submission
        ids the runs carried: a job whose node was lost before it started is an attempt that never ran.
        A trial whose last attempt never ran proves nothing, and is passed. Nor does any trial run more
        attempts than that, whatever its end."""
        job_dir = self._job_dir(trial)
        record = read_submission(JobPaths(job_dir))
        asha = AshaState.of(trial)
        budget = 1 + self.facts.max_restarts + (asha.promotions if asha is not None else 0)
        if record is not None and record.attempt > budget:
            self.violated(
                "a trial fails only once its restarts are spent",
                f"trial {trial.number} ({trial.state.name}) ran {record.attempt} attempts of the {budget} "
                f"its max_restarts {self.facts.max_restarts} and its promotions allow",
            )
        if trial.state is not TrialState.FAIL:
            return
        runs = [run for run in self.cluster.runs if run.job_dir == job_dir]
        if not runs or record is None or record.submission_id != runs[-1].attempt_key:
            return
        if not self._failed_by_itself(runs[-1]):
            return
        promotions = asha.promotions if asha is not None else 0
        attempts = record.attempt
        wanted = 1 + self.facts.max_restarts + promotions
        if attempts < wanted:
            self.violated(
                "a trial fails only once its restarts are spent",
                f"trial {trial.number} ends FAIL after {attempts} attempt(s) of the {wanted} its "
                f"max_restarts {self.facts.max_restarts} and {promotions} promotion(s) allow",
            )

    def _failed_by_itself(self, run: JobRun) -> bool:
        """The run's job ended on a failure no stop of tunepod's explains (a stop as hung is restarted
        like a failure). A run whose exit nobody could record (its local wrapper killed: the signals
        that then end it are no stop the backend hears) is the job dir's to tell, and passed."""
        reasons = {stop.reason for stop in self.cluster.stops if stop.job_id == run.job_id}
        if reasons - {"hung"} or run.exit_unrecorded:
            return False
        node_failed = any(
            failure.job_id == run.job_id and failure.outcome == "NODE_FAIL"
            for failure in self.cluster.node_failures
        )
        return bool(reasons) or node_failed or run.exit_code not in (0, None)

    def _asha_decided(self, trial: FrozenTrial) -> None:
        """Each pause, promotion and go-on of ASHA agrees with the referee's own rule
        (``simulation.decisions``)."""
        if self.halving is None:
            return
        writes = self.asha_writes.get(trial.number, [])
        for verdict in asha_verdicts(self.halving, trial, writes, self.told_log, self._job_ran):
            self.violated("ASHA decides by its rule", verdict)

    def _job_ran(self, number: int, at: float) -> bool:
        """A run of trial ``number``'s job dir was live at simulated time ``at``."""
        job_dir = self.facts.jobs_dir / f"trial-{number}"
        return any(
            run.job_dir == job_dir and run.started_at <= at and (run.ended_at is None or run.ended_at > at)
            for run in self.cluster.runs
        )

    def _continued_from_donors(self, trials: list[FrozenTrial]) -> None:
        """PBT: a continuation's first run resumes from its recorded donor's checkpoint at the recorded
        step (what the checkpoint says of itself: the trial that trained it, the step, the parameters),
        or from none where no checkpoint was copied (``from_step`` -1)."""
        by_number = {trial.number: trial for trial in trials}
        by_dir = {self._job_dir(trial).name: trial for trial in trials}
        for trial in trials:
            state = PbtState.of(trial)
            first = self._first_program_run(self._job_dir(trial))
            if state is None or first is None:
                continue
            origin = first.resumed_from
            got = None if origin is None else (str(origin["trial"]), int(str(origin["step"])))
            trained = by_dir.get(got[0]) if got is not None else None
            params_differ = origin is not None and trained is not None and origin["params"] != trained.params
            if got not in self._donor_checkpoints(by_number, state.parent, state.from_step) or params_differ:
                self.violated(
                    "a continuation resumes from its donor",
                    f"trial {trial.number} continues from trial {state.parent}'s step {state.from_step}, "
                    f"its job {first.job_id} resumed from {origin}",
                )

    def _first_program_run(self, job_dir: Path) -> JobRun | None:
        """The job dir's first run whose program began (one killed before cannot have resumed)."""
        return next((r for r in self.cluster.runs if r.job_dir == job_dir and r.first_step is not None), None)

    def _donor_checkpoints(
        self, by_number: dict[int, FrozenTrial], donor: int, step: int
    ) -> set[tuple[str, int] | None]:
        """The checkpoints that are ``donor``'s at ``step``: saved by its own jobs, or, for a
        continuation that started from that very step, its own donor's it was seeded with."""
        if step < 0:
            return {None}
        trial = by_number[donor]
        found: set[tuple[str, int] | None] = {(self._job_dir(trial).name, step)}
        state = PbtState.of(trial)
        if state is not None and state.from_step == step:
            found |= self._donor_checkpoints(by_number, state.parent, step)
        return found

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
        worlds = _world_points(JobPaths(self._job_dir(trial)).worlds)
        if worlds - logged:
            self.violated(
                "an elastic job loses a node, not its steps",
                f"trial {trial.number}: worlds not in MLflow {sorted(worlds - logged)[:5]}",
            )
        extra = logged - reported - worlds
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

    def _driven(self, number: int) -> bool:
        """A live orchestrator's thread drives trial ``number`` (the tuner names it ``trial-<n>``)."""
        name = f"trial-{number}"
        return any(t.name == name and t.process.alive and t.state is not State.DONE for t in self.sim.tasks)

    def _trials(self) -> list[FrozenTrial]:
        storage = self.database.storage
        try:
            study_id = storage.get_study_id_from_name(self.facts.study)
        except KeyError:
            return []
        return storage.get_all_trials(study_id, deepcopy=False)

    def _trial_of(self, job_dir: Path) -> FrozenTrial | None:
        return next((trial for trial in self._trials() if self._job_dir(trial) == job_dir), None)

    def _objective_seen(self, job_dir: Path) -> bool:
        paths = JobPaths(job_dir)
        reported = any(key == self.facts.metric for key, _, _ in _reported_points(paths.metrics))
        return reported or paths.result.exists()

    def _job_dir(self, trial: FrozenTrial) -> Path:
        return Path(str(trial.user_attrs.get(ATTR_JOB_DIR, self.facts.jobs_dir / f"trial-{trial.number}")))


def _world_points(path: Path) -> Counter[tuple[str, float, int]]:
    """What the mirror logs of a worlds file: each world's size at its step, once there was a change."""
    found = read_worlds(path)
    if len(found) < 2:
        return Counter()
    return Counter(
        (f"{tags.PREFIX}{tags.WORLD_SIZE}", float(world.world_size), world.step) for world in found
    )


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


def _paused_or_idle(trial: FrozenTrial) -> bool:
    state = AshaState.of(trial)
    return state is not None and (state.paused or state.idle)
