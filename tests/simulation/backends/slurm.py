"""A simulated Slurm controller behind the real ``SlurmLauncher``: it answers the very commands the
launcher runs (``sbatch --parsable``, ``squeue``, ``scontrol show job -o``, ``sacct``, ``scancel``)
with the text Slurm 22.05 prints, so the launcher's rendering and parsing run as they do on a cluster.

Modelled, as Slurm does it:

- ``sbatch`` reads the rendered script: ``#SBATCH --job-name``, ``--comment``, ``--output`` (the job
  dir), ``--time``, its ``export`` lines (the job's environment) and its ``EXIT`` trap, which bash runs
  when the script ends or is stopped by SIGTERM (a cancel, the time limit), not when its node dies;
  ids grow and never restart at 1;
- a job waits in the queue (PENDING) a little, then runs on ``--nodes`` of the compute nodes that
  are not DOWN (each with a clock of its own; PENDING, reason Resources, while too few are up); its
  program (rank 0, which writes the job dir) runs on the first, the batch host; it ends COMPLETED or
  FAILED with its exit code, TIMEOUT at its ``--time``;
- ``scancel``: PENDING -> CANCELLED at once; RUNNING -> COMPLETING (processes killed) -> CANCELLED;
- requeue (``scontrol requeue`` while faults are on; jobs are always sent with ``--requeue``): every
  process of the run is killed (the batch script's trap runs), the job shows REQUEUED, then waits
  (PENDING, BeginTime) under the same id, ``Restarts`` + 1, and runs again with a new ``StartTime``;
- a node failure (while faults are on): a node's slurmd dies (its processes go on, writing the
  shared job dirs) or its link is cut (its processes freeze; a job's ranks on other nodes wait in a
  collective, without advancing). The controller notices SlurmdTimeout later and marks the node
  DOWN: each job running on it is requeued as above, or, where Slurm does not requeue it, ends
  NODE_FAIL. Slurm kills the run's processes on the nodes that answer; those on the silent node
  outlive its decision until the node's namespaces are torn down (killed, not by Slurm), and no
  one hears how they end (their trap still writes the job dir). A job cancelled or timed out on a
  silent node stays COMPLETING until the node is DOWN; one started there never starts its script.
  The node comes back later (slurmd restarted) and takes jobs again;
- an elastic job (``--no-kill``, torchrun's ``--nnodes min:max``) is not requeued for a node that is
  not its first (the batch script's and the rendezvous') while at least ``min_nodes`` are left: its
  ranks there leave the group (at once where they are cut off or killed, when the node's namespaces
  end where only its slurmd died), the survivors re-form (``simulation.cluster``), and once the node
  is DOWN the job holds the nodes left, RUNNING under the same id. A lost first node, or too few
  left, ends the job's run as above. A node that stopped answering comes back rebooted: the memory
  tier's steps it held are gone;
- ``scontrol update nodename=X state=down`` (an operator's, while faults are on): the node is DOWN at
  once, its jobs are requeued (or end NODE_FAIL) at once and its slurmd kills their processes; it
  takes jobs again once resumed;
- an ended job stays in the controller's memory for ``MinJobAge`` seconds (``squeue --states=all``,
  ``scontrol``), then is purged; ``sacct`` answers only with accounting (slurmdbd), and lists
  comments only with ``AccountingStoreFlags=job_comment``;
- a command may fail as a busy controller does ("Socket timed out on send/recv operation"), before
  it takes effect, or after it (a lost ``sbatch`` reply: the job exists, the caller does not know).
"""

from __future__ import annotations

import random
import re
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from simulation.backends import Machine, Outage, ServiceFaults, rate, service_faults
from simulation.cluster import Cluster, JobRun, NodeFailure, Placement
from simulation.invariants import Referee
from simulation.scheduler import Host, Scheduler
from tunepod.launch.base import Launcher
from tunepod.launch.runner import CommandFailed, TransientCommandFailed, is_transient_failure
from tunepod.launch.slurm.launcher import SlurmLauncher
from tunepod.runtime.files import write_bytes_atomic
from tunepod.spec.models import SlurmLauncherSpec

_TIMED_OUT = "slurm_load_jobs error: Socket timed out on send/recv operation"
_INVALID = "slurm_load_jobs error: Invalid job id specified"
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}
_NODES = 3
"""Compute nodes: a two-node job still finds two while one is DOWN."""


@dataclass(frozen=True)
class SlurmFaults(ServiceFaults):
    """The controller's (a command unanswered; ``sbatch``/``scancel`` answers lost), requeues and the
    nodes' failures."""

    requeue_per_s: float = 0.0
    """Per running job and second: ``scontrol requeue``."""
    node_failure_per_s: float = 0.0
    """Per compute node and second: its slurmd dies or its link is cut (it stops answering)."""
    node_down_per_s: float = 0.0
    """Per compute node and second: ``scontrol update nodename=X state=down``."""
    node_fail: float = 0.0
    """The chance that Slurm cannot requeue a job a DOWN node ended: it ends NODE_FAIL."""


@dataclass(frozen=True)
class SlurmSettings:
    """The simulated cluster's configuration and faults."""

    faults: SlurmFaults
    min_job_age_s: float
    accounting: bool
    comments_in_accounting: bool
    slurmd_timeout_s: float = 300.0
    """How long a node may not answer before the controller marks it DOWN (Slurm's default: 300)."""
    kind: str = "slurm"

    def describe(self) -> str:
        return (
            f"slurm: {_NODES} nodes, MinJobAge {self.min_job_age_s:.0f}s, SlurmdTimeout "
            f"{self.slurmd_timeout_s:.0f}s, accounting {self.accounting} "
            f"(comments {self.comments_in_accounting}), faults {self.faults}"
        )

    def quiet(self) -> SlurmSettings:
        return replace(self, faults=SlurmFaults())

    def make(self, machine: Machine) -> SlurmBackend:
        return SlurmBackend(Slurmctld(machine, self))


def draw(random_: random.Random) -> SlurmSettings:
    return SlurmSettings(
        faults=SlurmFaults(**service_faults(random_), requeue_per_s=rate(random_, 0.002)),
        min_job_age_s=random_.choice([30.0, 300.0]),
        accounting=random_.random() < 0.5,
        comments_in_accounting=random_.random() < 0.5,
    )


def with_node_failures(settings: SlurmSettings, random_: random.Random) -> SlurmSettings:
    """``settings`` with the nodes' failures, drawn from a source of their own (the scenario's other
    draws stay what they were)."""
    faults = replace(
        settings.faults,
        node_failure_per_s=rate(random_, 0.01),
        node_down_per_s=rate(random_, 0.001),
        node_fail=random_.choice([0.0, 0.3, 1.0]),
    )
    return replace(settings, faults=faults, slurmd_timeout_s=random_.choice([30.0, 120.0, 300.0]))


class SlurmBackend:
    """The real ``SlurmLauncher`` of each orchestrator, all reaching one simulated controller."""

    def __init__(self, ctld: Slurmctld) -> None:
        self.ctld = ctld

    def launcher(self) -> Launcher:
        sim, root = self.ctld.sim, self.ctld.root
        spec = SlurmLauncherSpec(kind="slurm", root=str(root), poll_cache_s=sim.choices.pick([0.0, 2.0]))
        return SlurmLauncher(spec, runner=SimSlurmRunner(self.ctld), cancel_timeout_s=120.0)

    def faults_stop(self) -> None:
        self.ctld.faults_on = False


@dataclass
class SlurmNode:
    """A compute node: what the controller holds of it (DOWN or not), and what is so (it answers)."""

    host: Host
    down: bool = False
    reason: str = ""
    silent_since: float | None = None
    """When it stopped answering (slurmd dead, link cut); DOWN ``SlurmdTimeout`` after that."""
    cut_off: bool = False
    """Its link is cut (its processes reach neither the job dirs nor their peers), rather than its
    slurmd dead (they go on)."""
    namespace_ends_at: float = 0.0
    """When what still runs on the silent node is killed (its jobs' namespaces torn down)."""
    back_at: float | None = None
    """When a DOWN node comes back (slurmd restarted, an operator's ``state=resume``)."""

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def answers(self) -> bool:
        return self.silent_since is None


@dataclass
class SlurmJob:
    job_id: str
    name: str
    comment: str
    job_dir: Path
    env: dict[str, str]
    time_limit_s: float | None
    submitted_at: float
    start_after: float
    num_nodes: int = 1
    state: str = "PENDING"
    reason: str = "Priority"
    exit_code: int = 0
    signal: int = 0
    restarts: int = 0
    started_at: float | None = None
    ended_at: float | None = None
    exit_file: Path | None = None
    exit_fields: tuple[str, ...] = ()
    """Where the script's EXIT trap records how it ended (None: the script has no such trap)."""
    run: JobRun | None = field(default=None, repr=False)
    nodes: tuple[SlurmNode, ...] = field(default=(), repr=False)
    """Its allocation while it runs (or completes); the first is the batch host."""
    settles_at: float = 0.0
    """When a COMPLETING or REQUEUED job's epilog is over (its nodes that answer are released)."""
    final_state: str = ""
    """What a COMPLETING job ends as."""
    struck: NodeFailure | None = field(default=None, repr=False)
    """A node failure that struck its run and that the controller has not acted on yet."""
    min_nodes: int | None = None
    """An elastic job's (``--no-kill``, torchrun's ``--nnodes min:max``): the fewest nodes it runs on."""
    lost: list[SlurmNode] = field(default_factory=list, repr=False)
    """Nodes of an elastic job's run that its group went on without (no requeue, no NODE_FAIL)."""


class Slurmctld:
    """The controller and its nodes; see the module docstring."""

    def __init__(self, machine: Machine, settings: SlurmSettings) -> None:
        self.sim: Scheduler = machine.sim
        self.cluster: Cluster = machine.cluster
        self.referee: Referee = machine.referee
        self.root = machine.root
        self.nodes = [SlurmNode(host) for host in _compute_hosts(machine)]
        self.min_job_age_s = settings.min_job_age_s
        self.slurmd_timeout_s = settings.slurmd_timeout_s
        self.accounting = settings.accounting
        self.comments_in_accounting = settings.comments_in_accounting
        self.faults = settings.faults
        self.faults_on = True
        self.outage = Outage()
        sim = self.sim
        self.memory: dict[str, SlurmJob] = {}
        self.accounted: dict[str, SlurmJob] = {}
        self.doomed: list[tuple[float, JobRun]] = []
        """Runs on a silent node, and when its namespaces end (what kills them: not Slurm)."""
        self.doomed_ranks: list[tuple[float, JobRun, str]] = []
        """An elastic run's ranks on a node whose slurmd died: they train on with the others until
        the node's namespaces end (then the group re-forms without them)."""
        self._next_id = 1000 + sim.choices.integer(0, 5000)
        controller = sim.start_process("slurmctld", Host("head", "boot-head", "pid:[head]"))
        controller.spawn("control", self._control)

    # ------------------------------------------------------------------------------ the controller

    def _control(self) -> None:
        while True:
            self.sim.sleep(1.0)
            for node in self.nodes:
                self._node_tick(node)
            self._kill_doomed()
            self._doomed_ranks_end()
            for job in list(self.memory.values()):
                self._tick(job)

    def _tick(self, job: SlurmJob) -> None:
        now = self.sim.now
        if job.state == "PENDING" and now >= job.start_after:
            self._start(job)
        elif job.state == "RUNNING" and self._over_time(job):
            self._end_run(job, "TIMEOUT", "TimeLimit", exit_code=0, signal=15)
        elif job.state == "RUNNING" and self.faults_on and self.sim.choices.chance(self.faults.requeue_per_s):
            self._requeue(job, "scontrol requeue")
        elif job.state in ("COMPLETING", "REQUEUED") and now >= job.settles_at and self._released(job):
            self._settle(job)
        elif job.state in _ENDED and job.ended_at is not None and now - job.ended_at > self.min_job_age_s:
            del self.memory[job.job_id]
            self.sim.trace.event(now, "job", f"slurm purges job {job.job_id} (MinJobAge)")

    def _over_time(self, job: SlurmJob) -> bool:
        limit, started = job.time_limit_s, job.started_at
        return limit is not None and started is not None and self.sim.now - started >= limit

    def _start(self, job: SlurmJob) -> None:
        up = [node for node in self.nodes if not node.down]
        if len(up) < job.num_nodes:
            job.reason = "Resources"
            return
        picked: list[SlurmNode] = []
        for _ in range(job.num_nodes):
            picked.append(self.sim.choices.pick([node for node in up if node not in picked]))
        job.nodes, job.lost = tuple(picked), []
        job.state, job.reason, job.started_at = "RUNNING", "None", self.sim.now
        batch = picked[0]
        if not batch.answers:  # the launch goes to a node that no longer answers: the script never starts
            self.sim.trace.event(self.sim.now, "job", f"job {job.job_id} is sent to silent {batch.name}")
            self._struck(job)
            return
        placement = Placement(tuple(node.name for node in picked), job.min_nodes)
        job.run = self.cluster.start(
            job.job_dir,
            job.job_id,
            job.env,
            batch.host,
            lambda run: self._exited(job, run),
            placement=placement,
        )
        self.referee.job_started(job.job_dir)
        for node in picked[1:]:
            if not node.answers:
                self._silenced(job, node)

    def _exited(self, job: SlurmJob, run: JobRun) -> None:
        code = run.exit_code or 0
        if job.run is not run or not job.nodes[0].answers:
            # The script ended on a silent node (or one its job has left): its trap writes the job
            # dir, and the controller never hears of it.
            run.exit_unrecorded = True
            self._trap(job, code)
            return
        state, reason = ("COMPLETED", "None") if code == 0 else ("FAILED", "NonZeroExitCode")
        job.run, job.reason, job.exit_code = None, reason, code
        self._trap(job, code)
        if self._released(job):
            job.state, job.ended_at, job.nodes = state, self.sim.now, ()
        else:  # its epilog waits for a node that does not answer
            job.state, job.final_state, job.settles_at = "COMPLETING", state, self.sim.now

    def _trap(self, job: SlurmJob, code: int) -> None:
        """The batch script's EXIT trap, as bash runs it: its printf's arguments, each ``"$code"`` or a
        variable of the job's environment (Slurm's own included), joined by spaces."""
        if job.exit_file is None:
            return
        values = {**job.env, "SLURM_JOB_ID": job.job_id, "code": str(code)}
        fields = [values.get(name, "") for name in job.exit_fields]
        write_bytes_atomic(job.exit_file, (" ".join(fields) + "\n").encode())

    def _stop_run(self, job: SlurmJob, why: str, *, signal: int) -> None:
        """Slurm ends the job's run: killed where its batch host answers (the script's trap runs),
        else given up, left to its node's fate."""
        run, job.run = job.run, None
        if run is None or run.ended_at is not None:
            return
        if job.nodes[0].answers:
            self.cluster.kill(run, why)
            self._trap(job, 128 + signal)
        else:
            self.cluster.orphan(run, f"{why}; on {job.nodes[0].name}, which does not answer")
            # Its peers on the nodes that answer are killed: its next collective never completes.
            run.stuck = run.stuck or len(job.nodes) > 1

    def _end_run(self, job: SlurmJob, state: str, reason: str, *, exit_code: int, signal: int) -> None:
        """Through COMPLETING, which lasts while a node of the job neither answers nor is DOWN."""
        self._stop_run(job, f"slurm {state}", signal=signal)
        job.state, job.final_state, job.reason = "COMPLETING", state, reason
        job.exit_code, job.signal, job.settles_at = exit_code, signal, self.sim.now

    def _requeue(self, job: SlurmJob, why: str) -> None:
        self.sim.trace.event(self.sim.now, "fault", f"slurm requeues job {job.job_id} ({why})")
        self._stop_run(job, f"requeued ({why})", signal=15)
        job.state, job.restarts = "REQUEUED", job.restarts + 1
        job.settles_at = self.sim.now + self.sim.choices.uniform(0.5, 3.0)
        job.start_after = job.settles_at + self.sim.choices.uniform(5.0, 60.0)

    def _settle(self, job: SlurmJob) -> None:
        job.nodes = ()
        if job.state == "REQUEUED":
            job.state, job.reason = "PENDING", "BeginTime"
        else:
            job.state, job.ended_at = job.final_state, self.sim.now

    def _released(self, job: SlurmJob) -> bool:
        """No node of the job is silent and still up: the controller waits for one to answer."""
        return all(node.answers or node.down for node in job.nodes)

    # ------------------------------------------------------------------------------ the nodes

    def _node_tick(self, node: SlurmNode) -> None:
        now, chance = self.sim.now, self.sim.choices.chance
        if node.silent_since is not None and not node.down:
            if now - node.silent_since >= self.slurmd_timeout_s:
                self._set_down(node, "Not responding")
        elif node.down:
            if node.back_at is not None and now >= node.back_at:
                self._back(node)
        elif self.faults_on and chance(self.faults.node_failure_per_s):
            self._stops_answering(node)
        elif self.faults_on and chance(self.faults.node_down_per_s):
            self.sim.trace.event(now, "fault", f"scontrol update nodename={node.name} state=down")
            node.back_at = now + self.sim.choices.uniform(30.0, 300.0)
            self._set_down(node, "scontrol update state=down")

    def _stops_answering(self, node: SlurmNode) -> None:
        now, choices = self.sim.now, self.sim.choices
        node.silent_since, node.cut_off = now, choices.chance(0.5)
        node.namespace_ends_at = now + self.slurmd_timeout_s + choices.uniform(0.0, 120.0)
        node.back_at = node.namespace_ends_at + choices.uniform(10.0, 300.0)
        how = "its link is cut" if node.cut_off else "its slurmd dies"
        if self.cluster.memory is not None:
            self.cluster.memory.silent.add(node.name)
        self.sim.trace.event(now, "fault", f"{node.name} stops answering ({how})")
        for job in self._allocated(node):
            if job.state == "RUNNING":
                self._silenced(job, node)

    def _silenced(self, job: SlurmJob, node: SlurmNode) -> None:
        """What a node's silence does at once to the job running on it: the program goes on (slurmd
        dead), freezes (its batch host cut off) or waits for a peer that is gone (another node cut off);
        an elastic job's group goes on without a node that is not its first."""
        if node in job.lost:
            return
        if self._goes_on_without(job, node):
            self._loses_ranks(job, node)
            return
        self._struck(job)
        run = job.run
        if run is None or run.ended_at is not None:
            return
        if node is job.nodes[0]:
            self.doomed.append((node.namespace_ends_at, run))
            if node.cut_off:  # frozen past the controller's tick that kills it: it never writes again
                self.sim.stall(run.process, node.namespace_ends_at + 2.0 - self.sim.now)
                run.hung = True
        elif node.cut_off:
            run.stuck = True

    def _goes_on_without(self, job: SlurmJob, node: SlurmNode) -> bool:
        """An elastic job keeps running without ``node`` (``--no-kill``): not its first node (the batch
        script's and the rendezvous'), and at least ``min_nodes`` left."""
        left = [other for other in job.nodes if other is not node and other not in job.lost]
        return job.min_nodes is not None and node is not job.nodes[0] and len(left) >= job.min_nodes

    def _loses_ranks(self, job: SlurmJob, node: SlurmNode) -> None:
        """The ranks on ``node`` leave the group: at once where they are cut off or killed, else (its
        slurmd dead) once its namespaces end."""
        job.lost.append(node)
        run = job.run
        if run is None or run.ended_at is not None:
            return
        if node.answers or node.cut_off:
            self.cluster.lose_ranks(run, node.name)
        else:
            self.doomed_ranks.append((node.namespace_ends_at, run, node.name))

    def _doomed_ranks_end(self) -> None:
        now = self.sim.now
        for at, run, node in [entry for entry in self.doomed_ranks if entry[0] <= now]:
            self.doomed_ranks.remove((at, run, node))
            self.cluster.lose_ranks(run, node)

    def _struck(self, job: SlurmJob) -> None:
        """Record the failure for the referee, with the newest step saved when it struck."""
        if job.struck is None:
            job.struck = NodeFailure(
                self.sim.now, job.job_dir, job.job_id, self.cluster.newest_saved(job.job_dir)
            )
            self.cluster.node_failures.append(job.struck)

    def _set_down(self, node: SlurmNode, reason: str) -> None:
        node.down, node.reason = True, reason
        self.sim.trace.event(self.sim.now, "job", f"slurm marks {node.name} DOWN ({reason})")
        for job in self._allocated(node):
            if job.state == "RUNNING":
                self._node_failed(job, node)

    def _node_failed(self, job: SlurmJob, node: SlurmNode) -> None:
        if node in job.lost or self._goes_on_without(job, node):
            if node not in job.lost:  # set DOWN while it answered: its slurmd kills the ranks there
                self._loses_ranks(job, node)
            job.nodes = tuple(other for other in job.nodes if other is not node)
            self.sim.trace.event(
                self.sim.now, "job", f"job {job.job_id} runs on without {node.name} (--no-kill)"
            )
            return
        self._struck(job)
        failure, job.struck = job.struck, None
        assert failure is not None
        if self.sim.choices.chance(self.faults.node_fail):
            self.sim.trace.event(self.sim.now, "fault", f"job {job.job_id} ends NODE_FAIL ({node.name})")
            self._end_run(job, "NODE_FAIL", "NodeDown", exit_code=0, signal=0)
            failure.outcome = "NODE_FAIL"
        else:
            self._requeue(job, f"{node.name} is DOWN")
            failure.outcome = "requeued"
        failure.decided_at = self.sim.now

    def _back(self, node: SlurmNode) -> None:
        if node.silent_since is not None and self.cluster.memory is not None:
            self.cluster.memory.wipe(node.name)  # it stopped answering, and comes back rebooted
            self.cluster.memory.silent.discard(node.name)
        node.down, node.reason, node.silent_since, node.cut_off, node.back_at = False, "", None, False, None
        self.sim.trace.event(self.sim.now, "job", f"{node.name} is back (IDLE)")

    def _kill_doomed(self) -> None:
        now = self.sim.now
        for at, run in [entry for entry in self.doomed if entry[0] <= now]:
            self.doomed.remove((at, run))
            self.cluster.kill(run, "its node's namespaces are torn down")

    def _allocated(self, node: SlurmNode) -> list[SlurmJob]:
        return [job for job in self.memory.values() if node in job.nodes]

    # ------------------------------------------------------------------------------ the commands

    def run_command(self, argv: Sequence[str], stdin: str | None) -> tuple[int, str, str]:
        command = argv[0]
        if command == "sbatch":
            return self._sbatch(argv, stdin)
        if command == "squeue":
            return self._squeue(argv)
        if command == "scontrol":
            return self._scontrol(argv)
        if command == "sacct":
            return self._sacct(argv)
        if command == "scancel":
            return self._scancel(argv)
        return 127, "", f"{command}: command not found"

    def _sbatch(self, argv: Sequence[str], stdin: str | None) -> tuple[int, str, str]:
        script = stdin if stdin is not None else Path(argv[-1]).read_text()
        options = _sbatch_options(script)
        job_dir = Path(options["output"]).parent
        live = [job for job in self.memory.values() if job.job_dir == job_dir and job.state not in _ENDED]
        self.referee.job_created(job_dir, [job.job_id for job in live])
        self._next_id += 1
        job = SlurmJob(
            job_id=str(self._next_id),
            name=options.get("job-name", "sbatch"),
            comment=options.get("comment", ""),
            job_dir=job_dir,
            env=_exports(script),
            num_nodes=int(options.get("nodes", "1")),
            min_nodes=_min_nodes(script) if "no-kill" in options else None,
            time_limit_s=_time_limit_s(options.get("time")),
            exit_file=_exit_file(script),
            exit_fields=_exit_fields(script),
            submitted_at=self.sim.now,
            start_after=self.sim.now + self.sim.choices.uniform(0.0, 20.0),
        )
        self.memory[job.job_id] = job
        self.accounted[job.job_id] = job
        self.cluster.created[job_dir] = self.cluster.created.get(job_dir, 0) + 1
        self.sim.trace.event(
            self.sim.now, "job", f"sbatch: job {job.job_id} ({job_dir.name}) queued by {self.sim.process}"
        )
        return 0, f"{job.job_id}\n", ""

    def _squeue(self, argv: Sequence[str]) -> tuple[int, str, str]:
        fields = argv[argv.index("-o") + 1].split("|")
        if "-j" in argv:
            ids = argv[argv.index("-j") + 1].split(",")
            known = [self.memory[i] for i in ids if i in self.memory]
            if not known and len(ids) == 1:
                return 1, "", _INVALID
            listed = known
        else:
            listed = [job for job in self.memory.values() if _named(job, argv)]
            if "--states=all" not in argv:
                listed = [job for job in listed if job.state not in _ENDED]
        return 0, "".join("|".join(_field(job, f) for f in fields) + "\n" for job in listed), ""

    def _scontrol(self, argv: Sequence[str]) -> tuple[int, str, str]:
        if argv[1] in ("requeue", "update"):
            return self._scontrol_change(argv)
        job = self.memory.get(argv[-1])
        if job is None:
            return 1, "", _INVALID
        start = _iso(job.started_at) if job.started_at is not None else "Unknown"
        nodes = ",".join(node.name for node in job.nodes) or "(null)"
        line = (
            f"JobId={job.job_id} JobName={job.name} UserId=tunepod(1000) GroupId=tunepod(1000) "
            f"Priority=4294901757 JobState={job.state} Reason={job.reason} Dependency=(null) Requeue=1 "
            f"Restarts={job.restarts} BatchFlag=1 ExitCode={job.exit_code}:{job.signal} StartTime={start} "
            f"NodeList={nodes} Comment={job.comment or '(null)'}\n"
        )
        return 0, line, ""

    def _scontrol_change(self, argv: Sequence[str]) -> tuple[int, str, str]:
        """``scontrol requeue ID`` of a running job, and ``scontrol update JobId=ID NumNodes=N`` of a
        queued one (the launcher's requeue of an elastic job that lost its first node)."""
        if argv[1] == "requeue":
            job = self.memory.get(argv[2])
            if job is None or job.state != "RUNNING":
                return 1, "", f"Requeue of JobId={argv[2]} failed: Job is pending execution"
            self._requeue(job, "scontrol requeue")
            return 0, "", ""
        settings = dict(arg.split("=", 1) for arg in argv[2:])
        job = self.memory.get(settings.get("JobId", ""))
        if job is None:
            return 1, "", _INVALID
        job.num_nodes = int(settings["NumNodes"])
        return 0, "", ""

    def _sacct(self, argv: Sequence[str]) -> tuple[int, str, str]:
        if not self.accounting:
            return 1, "", "sacct: error: Slurm accounting storage is disabled"
        fields = argv[argv.index("-o") + 1].split(",")
        if "-j" in argv:
            job = self.accounted.get(argv[argv.index("-j") + 1])
            listed = [job] if job is not None else []
        else:
            listed = [job for job in self.accounted.values() if _named(job, argv)]
        lines = "".join("|".join(self._accounted_field(job, f) for f in fields) + "\n" for job in listed)
        return 0, lines, ""

    def _accounted_field(self, job: SlurmJob, name: str) -> str:
        if name == "State":
            return job.state
        if name == "ExitCode":
            return f"{job.exit_code}:{job.signal}"
        if name == "Reason":
            return job.reason
        if name == "JobIDRaw":
            return job.job_id
        if name == "Comment":
            return job.comment if self.comments_in_accounting else ""
        if name == "JobName":
            return job.name
        raise AssertionError(f"sacct field {name} is not simulated")

    def _scancel(self, argv: Sequence[str]) -> tuple[int, str, str]:
        job = self.memory.get(argv[-1])
        if job is None:
            return 1, "", f"scancel: error: Kill job error on job id {argv[-1]}: Invalid job id specified"
        if job.state in _ENDED or job.state == "COMPLETING":
            return (
                1,
                "",
                f"scancel: error: Kill job error on job id {job.job_id}: "
                "Job/step already completing or completed",
            )
        self.referee.stop_requested(job.job_dir, job.job_id)
        self.sim.trace.event(self.sim.now, "job", f"scancel {job.job_id} by {self.sim.process}")
        if job.state == "PENDING":
            job.state, job.reason, job.ended_at = "CANCELLED", "None", self.sim.now
            return 0, "", ""
        self._stop_run(job, "scancel", signal=15)
        job.state, job.final_state, job.exit_code, job.signal = "COMPLETING", "CANCELLED", 0, 15
        job.settles_at = self.sim.now + self.sim.choices.uniform(0.5, 3.0)
        return 0, "", ""


class SimSlurmRunner:
    """The ``CommandRunner`` an orchestrator's ``SlurmLauncher`` uses: the simulated controller, with
    latency and faults."""

    def __init__(self, ctld: Slurmctld) -> None:
        self.ctld = ctld

    def run(
        self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        sim, faults = self.ctld.sim, self.ctld.faults
        sim.takes(f"slurm {argv[0]}", sim.latency.api)
        if self.ctld.faults_on and (self.ctld.outage.on(sim) or sim.choices.chance(faults.transient)):
            sim.trace.event(sim.now, "fault", f"{sim.process}: {argv[0]} times out")
            raise TransientCommandFailed(argv, 1, _TIMED_OUT)
        code, stdout, stderr = self.ctld.run_command(argv, input)
        if (
            code == 0
            and argv[0] in ("sbatch", "scancel")
            and self.ctld.faults_on
            and sim.choices.chance(faults.lost_reply)
        ):
            sim.trace.event(sim.now, "fault", f"{sim.process}: {argv[0]} took effect; its reply is lost")
            self.ctld.outage.begins(sim, faults)
            raise TransientCommandFailed(argv, 1, _TIMED_OUT)
        if code != 0:
            if is_transient_failure(code, stderr):
                raise TransientCommandFailed(argv, code, stderr)
            raise CommandFailed(argv, code, stderr)
        return subprocess.CompletedProcess(list(argv), 0, stdout, stderr)


# ---------------------------------------------------------------------------------- the text


def _compute_hosts(machine: Machine) -> list[Host]:
    """The machine room's compute nodes, and as many more as the cluster has."""
    sim = machine.sim
    extra = [
        Host(f"node-{n}", f"boot-node-{n}", f"pid:[node-{n}]", skew_s=sim.choices.uniform(-2, 2))
        for n in range(len(machine.nodes), _NODES)
    ]
    return [*machine.nodes, *extra]


def _sbatch_options(script: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for line in script.splitlines():
        if not line.startswith("#SBATCH "):
            continue
        for word in shlex.split(line[len("#SBATCH ") :]):
            key, _, value = word.lstrip("-").partition("=")
            options[key] = value
    return options


def _exports(script: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in script.splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export ") :].partition("=")
            env[name] = shlex.split(value)[0] if value else ""
    return env


def _min_nodes(script: str) -> int | None:
    """An elastic job's fewest nodes: torchrun's ``--nnodes min:max``."""
    found = re.search(r"--nnodes[ =](\d+):(\d+)", script)
    return int(found.group(1)) if found else None


def _exit_fields(script: str) -> tuple[str, ...]:
    """The variables the EXIT trap's printf writes, in order (``"$code" "${X:-}"`` -> code, X)."""
    trap = next(
        (line for line in script.splitlines() if line.startswith("trap ") and line.endswith(" EXIT")), ""
    )
    printed = trap.partition("printf ")[2].partition(">")[0]
    return tuple(re.findall(r'"\$\{?(\w+)(?::-)?\}?"', printed))


def _exit_file(script: str) -> Path | None:
    """The file the script's EXIT trap writes, when it has one."""
    assigned = [line for line in script.splitlines() if line.startswith("tunepod_exit=")]
    has_trap = any(line.startswith("trap ") and line.endswith(" EXIT") for line in script.splitlines())
    return Path(shlex.split(assigned[0].partition("=")[2])[0]) if assigned and has_trap else None


def _time_limit_s(text: str | None) -> float | None:
    if not text:
        return None
    days, _, clock = text.rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60.0 + seconds


def _named(job: SlurmJob, argv: Sequence[str]) -> bool:
    names = [arg[len("--name=") :] for arg in argv if arg.startswith("--name=")]
    return not names or job.name in names[0].split(",")


def _field(job: SlurmJob, code: str) -> str:
    return {
        "%i": job.job_id,
        "%T": job.state,
        "%r": job.reason,
        "%D": str(len(job.nodes) or job.num_nodes),
        "%B": job.nodes[0].name if job.nodes else "n/a",
        "%N": ",".join(node.name for node in job.nodes),
        "%S": _iso(job.started_at) if job.state == "RUNNING" and job.started_at is not None else "N/A",
        "%k": job.comment or "(null)",
        "%j": job.name,
    }[code]


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S")
