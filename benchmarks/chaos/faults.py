"""The seeded fault driver: at random moments it injects one real fault into the running study.

Kinds are drawn in seeded rounds (every kind once, in a shuffled order, then the next round), so a
short soak still gets each kind; a kind that has no target at its moment (no trial running yet, the
MLflow server still restarting) waits for the next moment while the later kinds go ahead. The
moments are ``gap_s`` apart on average (uniform between half and one and a half of it). The seed
fixes the order of kinds and the gaps; which trial is hit depends on what runs at that moment.

Bounds that let the study finish: at most one job-level fault (job, rank, requeue) per trial, so a
trial needs at most one restart (``max_restarts`` leaves room for more); one orchestrator kill or
MLflow outage at a time, each only while a trial is in flight. Unless ``overlap`` is set, the two
never overlap: the orchestrator is not killed while MLflow is down, and MLflow is not killed while a
restarted ``tunepod run`` is still starting up, because a ``tunepod run`` that starts while the
tracking server is down fails at once (it opens the pipeline's MLflow run synchronously, with only
MLflow's own request retries; README, chaos soak). ``--overlap`` shows it.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from benchmarks.chaos.study import (
    ChaosStudy,
    MlflowServer,
    Orchestrator,
    TrialJob,
    job_processes,
    kill_groups,
    trial_jobs,
)
from tunepod.runtime.progress import read_progress


class Fault(StrEnum):
    JOB = "job killed"
    """SIGKILL every process group of a trial's job (wrapper, torchrun agent, both ranks)."""
    RANK = "rank killed"
    """SIGKILL rank 1 of a trial's two-rank job; rank 0 trains on until torchrun notices."""
    ORCHESTRATOR = "orchestrator killed"
    """SIGKILL the ``tunepod run`` process group, then start the same command again."""
    MLFLOW = "MLflow server killed"
    """SIGKILL the MLflow server's process group, restart it on the same port and store later."""
    REQUEUE = "Slurm requeue"
    """``scontrol requeue`` of a trial's running Slurm job."""


JOB_FAULTS = frozenset({Fault.JOB, Fault.RANK, Fault.REQUEUE})
#: Share of fault moments at which a job-level fault hits only a job that has reported an epoch.
MID_TRAINING_SHARE = 0.6


def kinds_for(launcher: str) -> list[Fault]:
    """The faults a launcher can take (a local job cannot be requeued)."""
    return [kind for kind in Fault if launcher == "slurm" or kind is not Fault.REQUEUE]


@dataclass(frozen=True)
class Injection:
    kind: Fault
    at_s: float
    """Seconds since the first trial of the study started."""
    trial: int | None
    detail: str


@dataclass
class FaultDriver:
    """Injects faults into one launcher's study until ``stop``; ``tend`` brings MLflow back."""

    study: ChaosStudy
    orchestrator: Orchestrator
    server: MlflowServer
    rng: random.Random
    gap_s: float
    overlap: bool = False
    """Allow an orchestrator start while MLflow is down (see the module docstring)."""
    outage_s: tuple[float, float] = (3.0, 10.0)
    started: float = field(default_factory=time.monotonic)
    injected: list[Injection] = field(default_factory=list)
    _queue: list[Fault] = field(default_factory=list)
    _next_at: float = 0.0
    _server_back_at: float | None = None
    _hit: set[int] = field(default_factory=set)
    _mid_training: bool = False

    def begin(self) -> None:
        """Start the clock: the first fault comes one drawn gap from now."""
        self.started = time.monotonic()
        self._next_at = self.started + self._gap()

    def step(self) -> None:
        """Inject the next fault if its moment has come and some queued kind has a target now."""
        if not self._next_at or time.monotonic() < self._next_at:
            return
        if not self._queue:
            self._queue = kinds_for(self.study.launcher)
            self.rng.shuffle(self._queue)
        for kind in self._queue:
            injection = self._inject(kind)
            if injection is not None:
                self._queue.remove(kind)
                self.injected.append(injection)
                self._next_at = time.monotonic() + self._gap()
                return

    def tend(self) -> None:
        """Restart the MLflow server once its outage has lasted its drawn time; call it every loop."""
        if self._server_back_at is not None and time.monotonic() >= self._server_back_at:
            self.server.start()
            self._server_back_at = None

    def mlflow_down(self) -> bool:
        return self._server_back_at is not None

    def _gap(self) -> float:
        """The wait until the next fault moment, and (drawn with it) what that moment may hit."""
        self._mid_training = self.rng.random() < MID_TRAINING_SHARE
        return self.gap_s * self.rng.uniform(0.5, 1.5)

    def _elapsed(self) -> float:
        return round(time.monotonic() - self.started, 1)

    def _inject(self, kind: Fault) -> Injection | None:
        injectors: dict[Fault, Callable[[], Injection | None]] = {
            Fault.JOB: self._kill_job,
            Fault.RANK: self._kill_rank,
            Fault.ORCHESTRATOR: self._kill_orchestrator,
            Fault.MLFLOW: self._kill_mlflow,
            Fault.REQUEUE: self._requeue,
        }
        return injectors[kind]()

    # ---------------------------------------------------------------------------------- targets

    def _target(self, running: Callable[[TrialJob], bool]) -> TrialJob | None:
        """A trial not hit before whose job runs, drawn at random; at this moment (``_mid_training``)
        either one that has reported an epoch (its restart resumes from a checkpoint) or any (most
        are still starting: torch imports, the rendezvous; the restart trains from scratch)."""
        candidates = [
            job
            for job in trial_jobs(self.study)
            if job.number not in self._hit and (job.reported() > 0 or not self._mid_training) and running(job)
        ]
        return self.rng.choice(candidates) if candidates else None

    def _in_flight(self) -> bool:
        """Some trial has reported: its job, MLflow run and checkpoints are all in play."""
        return any(job.reported() > 0 for job in trial_jobs(self.study))

    def _sent(self) -> bool:
        """Some trial's job was sent and still runs (reported or still starting): the orchestrator
        has something to find again after a restart. Wider than ``_in_flight``, so that a short study
        whose trials are mostly start-up still gives the orchestrator kill a moment."""
        return any(job_processes(job) for job in trial_jobs(self.study))

    # --------------------------------------------------------------------------------- injectors

    def _kill_job(self) -> Injection | None:
        job = self._target(lambda j: bool(job_processes(j)))
        if job is None:
            return None
        pids = job_processes(job)
        groups = kill_groups(pids, owned=set(pids))
        self._hit.add(job.number)
        detail = f"attempt {job.submission.attempt}, job {job.submission.job_id} after {job.reported()} "
        detail += f"reports: {len(pids)} processes, groups {groups}"
        return Injection(Fault.JOB, self._elapsed(), job.number, detail)

    def _kill_rank(self) -> Injection | None:
        job = self._target(lambda j: rank_pid(j, 1) is not None)
        pid = rank_pid(job, 1) if job is not None else None
        if job is None or pid is None:
            return None
        kill_groups([pid], owned=set())  # the pid alone: its group may hold the other rank
        self._hit.add(job.number)
        detail = f"attempt {job.submission.attempt}, rank 1 pid {pid} after {job.reported()} reports"
        return Injection(Fault.RANK, self._elapsed(), job.number, detail)

    def _requeue(self) -> Injection | None:
        job = self._target(lambda j: slurm_state(j.submission.job_id) == "RUNNING")
        if job is None:
            return None
        done = subprocess.run(
            ["scontrol", "requeue", str(job.submission.job_id)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if done.returncode != 0:  # it ended between the look and the requeue: no fault made
            return None
        self._hit.add(job.number)
        detail = f"job {job.submission.job_id} after {job.reported()} reports"
        return Injection(Fault.REQUEUE, self._elapsed(), job.number, detail)

    def _kill_orchestrator(self) -> Injection | None:
        if self.orchestrator.process is None or not self._sent():
            return None
        if not self.overlap and (self.mlflow_down() or not self.server.ready()):
            return None
        self.orchestrator.kill()
        self.orchestrator.start()
        detail = f"run {self.orchestrator.starts - 1} killed, run {self.orchestrator.starts} started"
        return Injection(Fault.ORCHESTRATOR, self._elapsed(), None, detail)

    def _kill_mlflow(self) -> Injection | None:
        if self.mlflow_down() or not self.server.ready() or not self._in_flight():
            return None
        if not self.overlap and not self.orchestrator.past_startup():
            return None
        self.server.kill()
        outage = self.rng.uniform(*self.outage_s)
        self._server_back_at = time.monotonic() + outage
        return Injection(Fault.MLFLOW, self._elapsed(), None, f"down {outage:.1f} s")


def rank_pid(job: TrialJob, rank: int) -> int | None:
    """The pid of ``rank`` of the job's current attempt, if that process lives (a heartbeat file left
    by an earlier attempt names a process that no longer carries this attempt's submission id)."""
    with contextlib.suppress(Exception):  # a heartbeat being rewritten: no target this round
        for beat in read_progress(job.paths.progress):
            if beat.rank == rank and not beat.finished and beat.pid in job_processes(job):
                return beat.pid
    return None


def slurm_state(job_id: str | None) -> str | None:
    if job_id is None:
        return None
    shown = subprocess.run(
        ["squeue", "-h", "-o", "%T", "-j", job_id], capture_output=True, text=True, timeout=30, check=False
    )
    return shown.stdout.strip() or None
