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

Node loss (a Slurm study whose trials span several nodes of partition ``nodes``, ``--nodes N``): one
node out at a time, and only a node whose every job is a job of a trial not hit before (never another
user's job; two trials' jobs often share a node, and then both count as hit). It comes back after a
drawn outage, a killed node not before the controller has marked it DOWN (a slurmd that returns sooner
is a restart, not a lost node); ``bring_nodes_back`` returns whatever is still out when the soak ends.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from benchmarks.chaos import nodes
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
    NODE_KILLED = "node killed"
    """``scripts/slurm-node kill`` of a node a trial's job runs on (a power cut), started again later."""
    NODE_DOWN = "node set down"
    """``scontrol update state=drain``, then ``state=down``, of a node a trial's job runs on (the
    controller's side of a lost node), ``state=resume`` later."""
    NODE_CUT = "node link cut"
    """``scripts/slurm-node cut`` of a node a trial's job runs on: its processes live on, unreachable
    (the job's ranks there stuck in a collective), until ``mend`` later, when Slurm kills them."""


NODE_FAULTS = frozenset({Fault.NODE_KILLED, Fault.NODE_DOWN, Fault.NODE_CUT})
JOB_FAULTS = frozenset({Fault.JOB, Fault.RANK, Fault.REQUEUE}) | NODE_FAULTS
#: Bound on the wait for the controller to mark a killed node DOWN (SlurmdTimeout 15 s, pings every 5 s)
#: before it is started again anyway.
MARKED_DOWN_LIMIT_S = 60.0
#: Pause before another try at bringing a node back after a failed one.
RETRY_S = 5.0
#: Share of fault moments at which a job-level fault hits only a job that has reported an epoch.
MID_TRAINING_SHARE = 0.6


def kinds_for(launcher: str, num_nodes: int = 1) -> list[Fault]:
    """The faults a launcher can take: a local job cannot be requeued, and a node is taken out only
    under a Slurm study of multi-node trials (on the namespaced nodes)."""
    if launcher != "slurm":
        return [kind for kind in Fault if kind is not Fault.REQUEUE and kind not in NODE_FAULTS]
    return [kind for kind in Fault if num_nodes > 1 or kind not in NODE_FAULTS]


@dataclass(frozen=True)
class Injection:
    kind: Fault
    at_s: float
    """Seconds since the first trial of the study started."""
    trials: tuple[int, ...]
    """The trials it hit (none for the study-wide faults; a node loss may hit several)."""
    detail: str


@dataclass
class NodeOutage:
    """A node the soak took out, and when it came back."""

    node: str
    kind: Fault
    out_at_s: float
    """Seconds since the first trial of the study started, as ``Injection.at_s``."""
    trials: tuple[int, ...]
    due: float
    """``time.monotonic()`` from which it may come back."""
    back_at_s: float | None = None
    problem: str = ""
    """Why bringing it back failed ('' when it did not)."""


@dataclass
class FaultDriver:
    """Injects faults into one launcher's study (``step``); ``tend`` brings MLflow and a lost node back
    when their time is up, ``bring_nodes_back`` at the end."""

    study: ChaosStudy
    orchestrator: Orchestrator
    server: MlflowServer
    rng: random.Random
    gap_s: float
    num_nodes: int = 1
    """Nodes per trial of a Slurm study: above 1, node losses are among the kinds."""
    overlap: bool = False
    """Allow an orchestrator start while MLflow is down (see the module docstring)."""
    outage_s: tuple[float, float] = (3.0, 10.0)
    node_outage_s: tuple[float, float] = (20.0, 40.0)
    started: float = field(default_factory=time.monotonic)
    injected: list[Injection] = field(default_factory=list)
    outages: list[NodeOutage] = field(default_factory=list)
    """Every node taken out, in order; at most the last one is still out."""
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
            self._queue = kinds_for(self.study.launcher, self.num_nodes)
            self.rng.shuffle(self._queue)
        for kind in self._queue:
            injection = self._inject(kind)
            if injection is not None:
                self._queue.remove(kind)
                self.injected.append(injection)
                self._next_at = time.monotonic() + self._gap()
                return

    def tend(self) -> None:
        """Restart the MLflow server and bring a node back once their outages have lasted their drawn
        time; call it every loop."""
        if self._server_back_at is not None and time.monotonic() >= self._server_back_at:
            self.server.start()
            self._server_back_at = None
        outage = self._node_out()
        if outage is not None and time.monotonic() >= outage.due and self._may_return(outage):
            self._bring_back(outage)

    def bring_nodes_back(self) -> list[NodeOutage]:
        """Bring back a node still out, whatever its outage's time; returns every outage."""
        outage = self._node_out()
        if outage is not None:
            self._bring_back(outage)
        return self.outages

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
            Fault.NODE_KILLED: lambda: self._take_node_out(Fault.NODE_KILLED),
            Fault.NODE_DOWN: lambda: self._take_node_out(Fault.NODE_DOWN),
            Fault.NODE_CUT: lambda: self._take_node_out(Fault.NODE_CUT),
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
        return Injection(Fault.JOB, self._elapsed(), (job.number,), detail)

    def _kill_rank(self) -> Injection | None:
        job = self._target(lambda j: rank_pid(j, 1) is not None)
        pid = rank_pid(job, 1) if job is not None else None
        if job is None or pid is None:
            return None
        kill_groups([pid], owned=set())  # the pid alone: its group may hold the other rank
        self._hit.add(job.number)
        detail = f"attempt {job.submission.attempt}, rank 1 pid {pid} after {job.reported()} reports"
        return Injection(Fault.RANK, self._elapsed(), (job.number,), detail)

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
        return Injection(Fault.REQUEUE, self._elapsed(), (job.number,), detail)

    def _kill_orchestrator(self) -> Injection | None:
        if self.orchestrator.process is None or not self._sent():
            return None
        if not self.overlap and (self.mlflow_down() or not self.server.ready()):
            return None
        self.orchestrator.kill()
        self.orchestrator.start()
        detail = f"run {self.orchestrator.starts - 1} killed, run {self.orchestrator.starts} started"
        return Injection(Fault.ORCHESTRATOR, self._elapsed(), (), detail)

    def _kill_mlflow(self) -> Injection | None:
        if self.mlflow_down() or not self.server.ready() or not self._in_flight():
            return None
        if not self.overlap and not self.orchestrator.past_startup():
            return None
        self.server.kill()
        outage = self.rng.uniform(*self.outage_s)
        self._server_back_at = time.monotonic() + outage
        return Injection(Fault.MLFLOW, self._elapsed(), (), f"down {outage:.1f} s")

    # ------------------------------------------------------------------------------------ node loss

    def _take_node_out(self, kind: Fault) -> Injection | None:
        """Kill or set down a node of a drawn trial's running job, one whose jobs are all trials of
        the study not hit before; every trial on it counts as hit."""
        if self._node_out() is not None:
            return None
        choices: dict[int, list[str]] = {}

        def takeable(job: TrialJob) -> bool:
            if slurm_state(job.submission.job_id) == "RUNNING":
                choices[job.number] = self._takeable_nodes(job)
            return bool(choices.get(job.number))

        job = self._target(takeable)
        if job is None:
            return None
        node = self.rng.choice(choices[job.number])
        trials = self._trials_on(node)
        if not trials:  # its jobs changed since the look (one ended, another user's came): no fault made
            return None
        failed = {Fault.NODE_KILLED: nodes.kill, Fault.NODE_DOWN: nodes.set_down, Fault.NODE_CUT: nodes.cut}[
            kind
        ](node)
        if failed:
            return None
        self._hit.update(trials)
        length = self.rng.uniform(*self.node_outage_s)
        at = self._elapsed()
        self.outages.append(NodeOutage(node, kind, at, trials, time.monotonic() + length))
        reports = [f"trial {j.number}: {j.reported()}" for j in trial_jobs(self.study) if j.number in trials]
        detail = f"node {node}, reports so far ({', '.join(reports)}), out for at least {length:.1f} s"
        return Injection(kind, at, trials, detail)

    def _takeable_nodes(self, job: TrialJob) -> list[str]:
        """The nodes of ``job`` that may be taken out now (``_trials_on``)."""
        return [node for node in nodes.job_nodes(str(job.submission.job_id)) if self._trials_on(node)]

    def _trials_on(self, node: str) -> tuple[int, ...]:
        """The trials whose jobs run on ``node`` when every job there is one of a trial of the study not
        hit before; () when any is not (another user's job, a trial already hit) or none runs."""
        ours = {j.submission.job_id: j.number for j in trial_jobs(self.study)}
        trials = [ours.get(job_id) for job_id in nodes.jobs_on(node)]
        if not trials or any(n is None or n in self._hit for n in trials):
            return ()
        return tuple(sorted(n for n in trials if n is not None))

    def _node_out(self) -> NodeOutage | None:
        last = self.outages[-1] if self.outages else None
        return last if last is not None and last.back_at_s is None else None

    def _may_return(self, outage: NodeOutage) -> bool:
        """A killed or cut-off node returns once the controller has marked it DOWN (or after a bound)."""
        if outage.kind is Fault.NODE_DOWN or time.monotonic() > outage.due + MARKED_DOWN_LIMIT_S:
            return True
        return nodes.node_states().get(outage.node, "").startswith("down")

    def _bring_back(self, outage: NodeOutage) -> None:
        """Start the node's slurmd or resume it; on failure note why and try again in a few seconds. A
        resume refused because the node already serves (someone else's test resumed it) brings it back."""
        back = {Fault.NODE_KILLED: nodes.start, Fault.NODE_DOWN: nodes.resume, Fault.NODE_CUT: nodes.mend}[
            outage.kind
        ]
        failed = back(outage.node)
        if failed and not nodes.in_service(nodes.node_states().get(outage.node, "")):
            outage.problem = failed
            outage.due = time.monotonic() + RETRY_S
        else:
            outage.problem = ""
            outage.back_at_s = self._elapsed()


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
