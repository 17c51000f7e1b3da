"""What a trial's job does once a backend runs it, and what the backends know for the invariants.

A job is a simulated process running the *training program*: it resumes from its newest checkpoint,
then for each sleep of the step's time reports one or several steps (a stride apart: a job of
thousands of steps in a few sleeps; sometimes twice at one step), saves a checkpoint and advances its
heartbeat, and at the end writes its result file (a final evaluation, not its last report) and exits
0. A report's append may be slow (two writes, a pause between), so a reader meets half a line, and a
kill in the pause, or a crash, leaves a torn line that the next run appends after. It writes the very
files a real job writes (``tunepod.runtime``'s formats: the metrics file, ``step-N`` checkpoints, the
heartbeat, the result file), on its node's clock, so the real orchestrator reads real job dirs. While
faults are on, the program may crash (exit 1) or hang (its loop stops advancing, its heartbeat goes
on) at a step, as the scenario's rates say.

Where a backend places a job on nodes (Slurm), the program knows them (``Placement``): with
checkpoint tiers it saves and restores through the nodes' memory as well (``simulation.node_memory``),
and an elastic job's ranks, one per node, beat each into its own heartbeat file. When an elastic
job's node that is not its first is lost, the survivors' step in flight fails; at the end of that
sleep they re-form as torchrun's agents do (a pause for the lost agent's keep-alives and the last
call, new workers, rank 0 forgetting the lost ranks' heartbeats with the runtime's
``forget_ranks_from``), restore the newest step complete on the nodes left, record the smaller world
in the worlds file, and train on under the same job and run.

``Cluster`` is the ground truth the invariants read: every job run, when it started and ended, on
whose request, whether it is hung, the requests to stop it with the reason its job dir gave, every
checkpoint a run saved, every report appended whole or torn, the node failures that struck runs,
the nodes elastic runs lost (``GroupLoss``) and the steps complete in each node's memory.
A run its backend gave up on (its node stopped answering: the job went on without it) is *orphaned*:
it no longer counts as its job's live run, though its processes may train on until they are killed.

A quality run (``simulation.quality``) gives the cluster a ``CurveModel`` instead: each step then
lasts and reports what the curve says for the trial's parameters, after a start-up and before an
exit (or after a stop signal) that take the curve's time, and every report is handed to
``on_report`` as it is appended.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from simulation.node_memory import MemoryTruth, RankZeroMemory
from simulation.scheduler import Host, Process, Scheduler, SimLock
from tunepod.launch.elastic import RDZV_KEEP_ALIVE_MAX_ATTEMPTS, RDZV_KEEP_ALIVE_S, RDZV_LAST_CALL_S
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_cancel_marker
from tunepod.runtime import CHECKPOINT_DIR_ENV, files, progress
from tunepod.runtime.checkpoints import latest_checkpoint, read_whole_state, save_checkpoint
from tunepod.runtime.contract import CHECKPOINT_TIERS_ENV
from tunepod.runtime.files import append_line_durably, write_bytes_atomic
from tunepod.runtime.progress import RankProgress
from tunepod.runtime.tiers import SaveTargets, read_checkpoint_tiers
from tunepod.runtime.worlds import World, last_world

HEARTBEAT_S = 10.0
ExitHook = Callable[["JobRun"], None]
"""Called when a run's program exits by itself: the backend records the outcome."""
ReportHook = Callable[["JobRun", int, Mapping[str, float]], None]
"""Called with each report (its run, step and metrics) as the program appends it."""


class CurveModel(Protocol):
    """What a trial trains, as a function of its parameters (the job's ``TUNEPOD_PARAMS``: the
    spec's ``train.args`` and the trial's sampled values): the objective at each step, how long each
    step takes, and the costs around them. A full trial reports steps ``0..num_steps - 1``."""

    @property
    def num_steps(self) -> int:
        """Steps of a full trial."""
        ...

    @property
    def startup_s(self) -> float:
        """A job's start to its first step's start (the interpreter, imports, data, the model)."""
        ...

    @property
    def exit_s(self) -> float:
        """A full trial's last report to its process's exit."""
        ...

    @property
    def stop_s(self) -> float:
        """A stopped job's signal (SIGTERM) to its process's exit; it trains no more meanwhile."""
        ...

    def value(self, params: Mapping[str, Any], step: int) -> float:
        """The objective reported at ``step``."""
        ...

    def step_s(self, params: Mapping[str, Any], step: int) -> float:
        """How long training ``step`` takes (up to its report)."""
        ...


@dataclass(frozen=True)
class JobFaults:
    """Per step of a job, while faults are on: the chance it crashes, and that it hangs."""

    crash: float = 0.0
    hang: float = 0.0
    slow_start: float = 0.0
    """Per run: the chance its first heartbeat comes up to ``slow_start_s`` late (an image pull, a
    slow mount, imports)."""
    slow_start_s: float = 0.0
    never_starts: float = 0.0
    """Per run: the chance it never gets to its first heartbeat (stuck starting up)."""
    preempt: float = 0.0
    """Per step: the chance the backend stops the run with a signal its script saves on (a preemption,
    a spot interruption, a SIGTERM): it saves its checkpoint and exits 0 (``ctx.should_stop()``)."""


@dataclass(frozen=True)
class Program:
    """The training every trial runs: ``steps`` steps, a report (and a checkpoint) every ``stride``
    of them, ``reports_per_sleep`` reports in each sleep of ``step_s`` seconds."""

    steps: int
    step_s: float
    same_step_reports: float = 0.0
    """The chance a step reports a second metric in a second line (one step, two reports)."""
    writes_result: bool = True
    """Whether the script ends with ``ctx.finish`` (a result file); without, it just exits 0."""
    stride: int = 1
    """Steps between two reports: it reports at steps 0, ``stride``, ``2 * stride``... up to its last
    step, ``steps - 1`` (a multiple of it). Above 1: a job of thousands of steps, whose reports past
    step 1,000 Optuna is told only some of (``tunepod.hpo.tuner.next_step_to_tell``)."""
    reports_per_sleep: int = 1
    """Reports trained in one sleep of ``step_s``, after which the program saves one checkpoint and
    beats: thousands of steps in a few simulated events (faults strike once per sleep)."""
    metrics: tuple[str, ...] = ("score",)
    """The metrics every report holds (and the result file): the study's objectives."""
    keep: int = 2
    """The checkpoints a run keeps (``save_checkpoint``'s ``keep``): each save prunes the older ones,
    a PBT donor's too while an exploited member copies its newest step."""
    torn_appends: float = 0.0
    """The chance one report's append is slow (a busy shared filesystem): its line is written in two
    parts with a pause between, so a reader meets it half written, and a kill in the pause leaves a
    torn line (the next run appends after it). A crash at a sleep tears the line it was writing with
    this chance too."""

    @property
    def sleep_steps(self) -> int:
        """The steps one sleep trains: a unit of ASHA's rungs and of PBT's interval."""
        return self.stride * self.reports_per_sleep

    @property
    def sleeps(self) -> int:
        """The sleeps of a whole run (its duration is ``sleeps * step_s``)."""
        return -(-self.points // self.reports_per_sleep)

    @property
    def points(self) -> int:
        """The reports of a whole run (one per ``stride`` steps)."""
        return (self.steps - 1) // self.stride + 1

    def steps_of_sleep(self, first: int) -> range:
        """The report steps trained in the sleep that starts at step ``first``."""
        return range(first, min(self.steps, first + self.sleep_steps), self.stride)


@dataclass(frozen=True)
class Placement:
    """The nodes a run's job was given, rank order: one rank on each, rank 0 (the batch script's,
    which writes the job dir) on the first. ``min_nodes`` below their count: an elastic job
    (``resources.min_nodes``), whose group re-forms without a lost node that is not the first."""

    nodes: tuple[str, ...]
    min_nodes: int | None = None

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < len(self.nodes)


@dataclass
class JobRun:
    """One run of one backend job (a requeued job runs again: a new run, the same job)."""

    job_dir: Path
    job_id: str
    attempt_key: str
    """The submission id the job carries: one attempt, maybe several runs."""
    started_at: float
    process: Process
    ended_at: float | None = None
    exit_code: int | None = None
    last_progress_at: float = 0.0
    hung: bool = False
    wrote_result: bool = False
    """Its program wrote its result file (``ctx.finish``): its training is done, whatever its exit (a
    kill may land between the write and the exit)."""
    result_at: float | None = None
    exit_unrecorded: bool = False
    """What recorded its exit code is gone (a local job's wrapper was killed), or its backend never
    heard it (a Slurm node that stopped answering): nothing can tell how it ended but its job dir."""
    orphaned_at: float | None = None
    """When its backend gave it up (its node stopped answering and its job went on without it)."""
    stuck: bool = False
    """Its program can no longer advance (a peer node cut off): it hangs at its next step."""
    first_step: int | None = None
    """The step its program started at (the step after the checkpoint it resumed from)."""
    newest_saved: int | None = None
    """The newest step any run of its job dir had saved when it started (ground truth)."""
    beating_at: float | None = None
    """When its program sent its first heartbeat (None: still starting up, or never)."""
    preempted_at: float | None = None
    """When the backend stopped it with a signal its script saved on and exited 0 by."""
    saved_when_preempted: int | None = None
    """The newest step of its job dir saved when it was preempted: the next run resumes after it."""
    beats_over: bool = False
    """Its last heartbeat (``finished``) is written: as the runtime's, no beat comes after it."""
    beat_lock: SimLock | None = None
    """One heartbeat write at a time, as the runtime's lock does (a beat built before the last one
    must not land after it)."""
    wall_readings: dict[float, float] = field(default_factory=dict)
    """A moment of true time -> its host's wall clock then, as the runtime reads it once (its start,
    an advance, a stop signal) and keeps it: a later jump of that clock moves none of them."""
    resumed_from: dict[str, object] | None = None
    """What the checkpoint it resumed from says of itself (``checkpoint_state``); None without one."""
    placement: Placement | None = None
    """Its nodes (a backend that places jobs on nodes says which); None: one node, unnamed."""
    lost: list[str] = field(default_factory=list)
    """Nodes of an elastic run whose ranks are gone (its group re-forms without them)."""
    losses_seen: int = 0
    """How many of ``lost`` its program has re-formed without."""
    generation: int = 0
    """How often its workers were restarted into a new group (torchrun's elastic restarts)."""
    workers_started_at: float | None = None
    """When its current workers started (None: with the run)."""
    memory: RankZeroMemory | None = None
    """Its memory tier, with checkpoint tiers on a backend that places jobs on nodes."""

    @property
    def group(self) -> list[str]:
        """The nodes whose ranks still train together, rank order."""
        nodes = self.placement.nodes if self.placement is not None else ()
        return [node for node in nodes if node not in self.lost]


@dataclass
class NodeFailure:
    """A node failure (or a node set DOWN) that struck a run of a job."""

    at: float
    job_dir: Path
    job_id: str
    saved: int | None
    """The newest step saved in the job dir when it struck: the next run must not start before it."""
    outcome: str = ""
    """What the backend made of it: ``requeued`` or ``NODE_FAIL`` (empty until it decided)."""
    decided_at: float | None = None


@dataclass
class GroupLoss:
    """A node of an elastic run lost while its job runs on (no requeue, no NODE_FAIL)."""

    at: float
    job_dir: Path
    job_id: str
    node: str
    newest: int | None
    """The newest step complete when it struck, in memory on a node left in the group or on the
    shared file system: the survivors resume from it or a newer one."""
    resumed: int | None = None
    """The step the survivors restored (None: not yet, or a fresh start)."""
    newest_at_restore: int | None = None
    """The newest step complete where the survivors could read it, when they restored."""
    restored_at: float | None = None


@dataclass
class StopRequest:
    at: float
    job_dir: Path
    job_id: str
    by: str
    reason: str | None


@dataclass
class Cluster:
    """Every job run of the seed, and the stops asked for (see the module docstring)."""

    sim: Scheduler
    program: Program
    faults: JobFaults
    faults_on: bool = True
    curve: CurveModel | None = None
    """What every trial trains in a quality run; None: ``program``'s own objectives and step time."""
    on_report: ReportHook | None = None
    heartbeats: bool = True
    """Whether a running program beats every ``HEARTBEAT_S`` besides at each step. Only a hang
    detection within a step needs them, which a quality run (no faults) does without."""
    runs: list[JobRun] = field(default_factory=list)
    stops: list[StopRequest] = field(default_factory=list)
    created: dict[Path, int] = field(default_factory=dict)
    """Jobs ever created per job dir (a backend's count, for the trace)."""
    saves: dict[Path, list[int]] = field(default_factory=dict)
    """Every checkpoint step saved per job dir, in order (a step saved again is listed again)."""
    node_failures: list[NodeFailure] = field(default_factory=list)
    late_reports: dict[Path, list[tuple[str, float, int]]] = field(default_factory=dict)
    """Per job dir, what orphaned runs reported (key, value, step) after they were orphaned."""
    appended: dict[Path, list[tuple[str, float, int]]] = field(default_factory=dict)
    """Per job dir, every report (key, value, step) whose line its metrics file got whole."""
    torn: dict[Path, list[tuple[str, float, int]]] = field(default_factory=dict)
    """Per job dir, the reports whose line was torn (a run killed or crashed mid-append, or one
    whose slow append another run's cut in two)."""
    memory: MemoryTruth | None = None
    """The nodes' memory (``simulation.node_memory``), where a backend places jobs on nodes."""
    group_losses: list[GroupLoss] = field(default_factory=list)

    def live_runs(self, job_dir: Path) -> list[JobRun]:
        """The runs its backend counts as its jobs' (an orphaned run may live on, lost to it)."""
        return [
            run
            for run in self.runs
            if run.job_dir == job_dir and run.ended_at is None and run.orphaned_at is None
        ]

    def newest_saved(self, job_dir: Path) -> int | None:
        return max(self.saves.get(job_dir, []), default=None)

    def newest_complete(self, run: JobRun) -> int | None:
        """The newest step ``run`` could restore: on the shared file system, or complete in the memory
        of a node of its group that answers (ground truth, apart from the files)."""
        shared = self.newest_saved(run.job_dir)
        if run.memory is None or self.memory is None:
            return shared
        memory = self.memory.newest_on(run.group, run.job_dir)
        return max((step for step in (shared, memory) if step is not None), default=None)

    def lose_ranks(self, run: JobRun, node: str) -> None:
        """The ranks of an elastic run on ``node`` are gone (killed, or cut off from the others): its
        group re-forms without them at its program's next step."""
        if run.ended_at is not None or node in run.lost or node not in run.group:
            return
        run.lost.append(node)
        newest = self.newest_complete(run)
        self.group_losses.append(GroupLoss(self.sim.now, run.job_dir, run.job_id, node, newest))
        self.sim.trace.event(
            self.sim.now,
            "fault",
            f"job {run.job_id} loses its ranks on {node} (newest complete step {newest})",
        )

    def start(
        self,
        job_dir: Path,
        job_id: str,
        env: Mapping[str, str],
        node: Host,
        on_exit: ExitHook,
        *,
        paths: JobPaths | None = None,
        placement: Placement | None = None,
    ) -> JobRun:
        """Start a run of a job with environment ``env`` on ``node``; ``on_exit(run)`` once its
        program ends by itself (not when it is killed). ``paths``: where the program writes its
        reports, heartbeats, checkpoints and result (default: ``job_dir``'s; a backend whose jobs
        write elsewhere, such as SageMaker without a writable FSx, says where). ``placement``: the
        nodes of its ranks, where the backend places jobs on nodes (the memory tier and elastic
        groups live there)."""
        process = self.sim.start_process(f"job {job_id}", node)
        self.sim.starts_late(process, self.sim.latency.process_start)
        attempt_key = env.get("TUNEPOD_SUBMISSION_ID", "")
        run = JobRun(job_dir, job_id, attempt_key, self.sim.now, process, last_progress_at=self.sim.now)
        run.placement = placement
        self.runs.append(run)
        self.sim.trace.event(self.sim.now, "job", f"job {job_id} runs ({job_dir.name})")
        params = dict(json.loads(env.get("TUNEPOD_PARAMS", "{}")))
        writes = paths if paths is not None else JobPaths(job_dir)
        run.memory = self._memory_tier(run, env, writes)
        if env.get(CHECKPOINT_DIR_ENV, str(writes.checkpoints)) != str(writes.checkpoints):
            process.spawn("evaluate", lambda: self._evaluate(run, writes, params, on_exit))
        else:
            process.spawn("train", lambda: self._train(run, writes, params, on_exit))
        return run

    def kill(self, run: JobRun, why: str) -> None:
        """End a run's processes (a cancel, a requeue, a time limit): nothing more of it happens."""
        if run.ended_at is not None:
            return
        self.sim.crash(run.process, why)
        run.ended_at = self.sim.now
        self.sim.trace.event(self.sim.now, "job", f"job {run.job_id} killed: {why}")

    def orphan(self, run: JobRun, why: str) -> None:
        """Its backend gives the run up while its processes may live on (see the module docstring)."""
        if run.ended_at is not None or run.orphaned_at is not None:
            return
        run.orphaned_at = self.sim.now
        self.sim.trace.event(self.sim.now, "job", f"job {run.job_id}: a run is given up, alive: {why}")

    def _memory_tier(self, run: JobRun, env: Mapping[str, str], paths: JobPaths) -> RankZeroMemory | None:
        tiers = read_checkpoint_tiers(env, CHECKPOINT_TIERS_ENV)
        if tiers is None or self.memory is None or run.placement is None:
            return None
        nonce = f"{run.job_id}.{len(self.runs)}.0"
        return RankZeroMemory(
            self.sim, self.memory, tiers, run.job_dir, paths.checkpoints, lambda: run.group, nonce
        )

    def stop_requested(self, job_dir: Path, job_id: str) -> None:
        marker = read_cancel_marker(JobPaths(job_dir))
        reason = marker.reason if marker is not None else None
        self.stops.append(StopRequest(self.sim.now, job_dir, job_id, self.sim.process.name, reason))

    # ------------------------------------------------------------------------------ the program

    def _train(self, run: JobRun, paths: JobPaths, params: dict[str, float], on_exit: ExitHook) -> None:
        sim, program = self.sim, self.program
        step = self._resume(run, paths)
        self._start_up(run)
        self._beat(run, paths, step=None)
        if self.heartbeats:
            run.process.spawn("heartbeat", lambda: self._heartbeats(run, paths))
        while step < program.steps:
            sim.sleep(self._step_s(params, step))
            if len(run.lost) > run.losses_seen:  # a collective of this step failed: a lost node
                step = self._reform(run, paths)
                continue
            if self.faults_on and sim.choices.chance(self.faults.crash):
                if sim.choices.chance(program.torn_appends):
                    self._tear(run, paths, step, params)
                self._exit(run, 1, on_exit, f"crashed at step {step}")
                return
            if run.stuck or (self.faults_on and sim.choices.chance(self.faults.hang)):
                run.hung = True
                sim.trace.event(sim.now, "fault", f"job {run.job_id} hangs at step {step}")
                sim.block(None, "hung")  # forever: only a kill ends it
            step = self._train_a_sleep(run, paths, params, step)
            run.last_progress_at = sim.now
            self._beat(run, paths, step=step)
            if step + program.stride < program.steps and self._preempted(run, paths, step, params):
                self._exit(run, 0, on_exit, f"preempted: saved step {step} and stopped")
                return
            step += program.stride
        if program.writes_result:
            if not self._flush_memory(run, paths):  # ctx.finish
                self._exit(run, 1, on_exit, "ctx.finish could not copy its newest memory step")
                return
            self._finish(run, paths, params, step - program.stride)
        self._beat(run, paths, step=step - program.stride, finished=True)
        if self.curve is not None and self.curve.exit_s > 0:
            sim.sleep(self.curve.exit_s)
        self._exit(run, 0, on_exit, "finished")

    def _resume(self, run: JobRun, paths: JobPaths) -> int:
        """The first step of the run's program: the one after the step it restores."""
        if run.memory is None:
            latest = latest_checkpoint(paths.checkpoints)
            run.newest_saved = self.newest_saved(run.job_dir)
            restored, state = (latest.step, read_whole_state(latest)) if latest is not None else (None, None)
        else:
            run.newest_saved = self.newest_complete(run)
            restored, state = self._restore_tiered(run, paths)
        run.first_step = restored + self.program.stride if restored is not None else 0
        run.resumed_from = json.loads(state) if state is not None else None
        if run.placement is not None and run.placement.elastic:
            run.losses_seen = len(run.lost)  # lost before it started: its first group forms without them
            progress.forget_ranks_from(paths.progress, len(run.group))  # as runtime.init, at every start
            self._note_world(run, paths, restored)
        return run.first_step

    def _restore_tiered(self, run: JobRun, paths: JobPaths) -> tuple[int | None, bytes | None]:
        assert run.memory is not None
        restored = run.memory.restore(paths.restores, self._now(run))
        if restored is None:
            return None, None
        self.sim.trace.event(
            self.sim.now, "job", f"job {run.job_id} restores step {restored.step} from {restored.tier}"
        )
        return restored.step, restored.state

    def _reform(self, run: JobRun, paths: JobPaths) -> int:
        """What torchrun's elastic agents do once a node's ranks are gone: the survivors' next
        rendezvous round waits out the lost agent's keep-alives and its last call, then new workers
        (rank 0 forgets the lost ranks' heartbeats, as ``runtime.init`` does) restore the newest step
        complete on the nodes left and record the smaller world. The job runs on: same job, same run."""
        sim = self.sim
        lost = run.lost[run.losses_seen :]
        sim.trace.event(sim.now, "job", f"job {run.job_id}: its group re-forms without {', '.join(lost)}")
        missed = RDZV_KEEP_ALIVE_S * RDZV_KEEP_ALIVE_MAX_ATTEMPTS
        sim.sleep(sim.choices.uniform(missed, missed + RDZV_LAST_CALL_S))
        run.losses_seen = len(run.lost)
        run.generation += 1
        run.workers_started_at = run.last_progress_at = sim.now
        if run.memory is not None:
            run.memory.nonce = f"{run.job_id}.{self.runs.index(run)}.{run.generation}"
        progress.forget_ranks_from(paths.progress, len(run.group))
        newest = self.newest_complete(run)
        if run.memory is None:
            latest = latest_checkpoint(paths.checkpoints)
            restored = latest.step if latest is not None else None
        else:
            restored = self._restore_tiered(run, paths)[0]
        for loss in self.group_losses:
            if loss.job_id == run.job_id and loss.node in run.lost and loss.restored_at is None:
                loss.resumed, loss.newest_at_restore, loss.restored_at = restored, newest, sim.now
        self._note_world(run, paths, restored)
        self._beat(run, paths, step=restored)
        return restored + self.program.stride if restored is not None else 0

    def _note_world(self, run: JobRun, paths: JobPaths, step: int | None) -> None:
        """Rank 0's record of its world when it differs from the last one (``runtime.worlds``, one
        rank per node), with its node's wall clock as the record's time."""
        previous = last_world(paths.worlds)
        size = len(run.group)
        if previous == (size, size):
            return
        before = previous if previous is not None else (None, None)
        world = World(step or 0, size, size, before[0], before[1], self._now(run))
        append_line_durably(paths.worlds, world.to_json())

    def _flush_memory(self, run: JobRun, paths: JobPaths) -> bool:
        """``ctx.finish`` with checkpoint tiers: the newest memory step to the shared folder when it is
        newer, then the job's memory folders removed; False when that step is out of reach (restored
        from a peer that no longer answers): ``finish`` raises, and the script fails."""
        if run.memory is None:
            return True
        step = run.memory.newest_unshared()
        if step is not None:
            state = run.memory.memory_state(step)
            if state is None:
                return False
            self._save_shared(run, paths, state, step)
            run.memory.saved(step, SaveTargets(shared=True, memory=False))
        run.memory.forget()
        return True

    def _start_up(self, run: JobRun) -> None:
        """Up to the first heartbeat (``runtime.init``): at once, late, or never (see ``JobFaults``)."""
        sim, faults = self.sim, self.faults
        if self.faults_on and sim.choices.chance(faults.never_starts):
            sim.trace.event(sim.now, "fault", f"job {run.job_id} never gets to its first heartbeat")
            sim.block(None, "starting up")  # forever: only a kill ends it
        if self.faults_on and sim.choices.chance(faults.slow_start):
            delay = sim.choices.uniform(0.0, faults.slow_start_s)
            sim.trace.event(sim.now, "job", f"job {run.job_id} takes {delay:.0f}s to start up")
            sim.sleep(delay)
        if self.curve is not None and self.curve.startup_s > 0:
            sim.sleep(self.curve.startup_s)
        run.beating_at = run.last_progress_at = sim.now

    def _preempted(self, run: JobRun, paths: JobPaths, step: int, params: dict[str, float]) -> bool:
        """Whether the backend stops the run now, after the checkpoint of ``step`` (the script sees
        ``ctx.should_stop()`` at its next step and saves; its heartbeat tells when it was asked). Only
        a run that writes its job dir: elsewhere nobody could tell a preemption from an end."""
        sim = self.sim
        if paths.checkpoints.parent != run.job_dir:
            return False
        if not (self.faults_on and sim.choices.chance(self.faults.preempt)):
            return False
        run.preempted_at = sim.now
        if run.memory is not None:  # the script saves once more on the signal: a stop's save is shared
            self._save_shared(run, paths, checkpoint_state(run, step, params), step)
            run.memory.saved(step, SaveTargets(shared=True, memory=True))
        run.saved_when_preempted = self.newest_saved(run.job_dir)
        sim.trace.event(
            sim.now, "fault", f"job {run.job_id} is preempted (a stop signal its script saves on)"
        )
        self._beat(run, paths, step=self._last_step(paths), finished=True)
        return True

    def _evaluate(self, run: JobRun, paths: JobPaths, params: dict[str, float], on_exit: ExitHook) -> None:
        """An evaluation: it reads the checkpoint it was given, scores it for one step's time (no
        heartbeat, as an evaluation sends none), writes its result and exits 0; it may crash."""
        sim = self.sim
        sim.sleep(self.program.step_s)
        if self.faults_on and sim.choices.chance(self.faults.crash):
            self._exit(run, 1, on_exit, "crashed evaluating")
            return
        self._finish(run, paths, params, self.program.steps - 1)
        self._exit(run, 0, on_exit, "evaluated")

    def _train_a_sleep(self, run: JobRun, paths: JobPaths, params: dict[str, float], first: int) -> int:
        """Report the steps of the sleep that starts at ``first``, then checkpoint the last one: its step."""
        step = first
        for step in self.program.steps_of_sleep(first):
            self._report(run, paths, step, self._metrics(params, step))
            if self.sim.choices.chance(self.program.same_step_reports):
                self._report(run, paths, step, {"loss": round(1.0 - score(params, step), 6)})
        state = checkpoint_state(run, step, params)
        if run.memory is None:
            self._save_shared(run, paths, state, step)
            return step
        targets = run.memory.targets(step)
        if targets.shared:
            self._save_shared(run, paths, state, step)
        if targets.memory:
            run.memory.save_to_memory(state, step, self.sim.choices.uniform(0.0, self.program.step_s / 4))
        run.memory.saved(step, targets)
        return step

    def _save_shared(self, run: JobRun, paths: JobPaths, state: bytes, step: int) -> None:
        save_checkpoint(paths.checkpoints, state, step, keep=self.program.keep)
        if paths.checkpoints.parent == run.job_dir:
            self.saves.setdefault(run.job_dir, []).append(step)

    def _metrics(self, params: dict[str, float], step: int) -> dict[str, float]:
        if self.curve is not None:
            value = self.curve.value(params, step)
            return {name: value for name in self.program.metrics}
        return {name: OBJECTIVES[name](params, step) for name in self.program.metrics}

    def _step_s(self, params: dict[str, float], step: int) -> float:
        return self.program.step_s if self.curve is None else self.curve.step_s(params, step)

    def _finish(self, run: JobRun, paths: JobPaths, params: dict[str, float], step: int) -> None:
        # The final evaluation (what ``ctx.finish`` is given) differs from the last report: a trial's
        # value is the result's where there is one, its last report's where there is none.
        final = {name: round(value + FINAL_BONUS, 6) for name, value in self._metrics(params, step).items()}
        write_bytes_atomic(
            paths.result,
            json.dumps({"metrics": final, "step": step, "time": self._now(run)}).encode(),
        )
        run.wrote_result = paths.result.parent == run.job_dir
        run.result_at = self.sim.now

    def _exit(self, run: JobRun, code: int, on_exit: ExitHook, why: str) -> None:
        if run.memory is not None:
            run.memory.forget()  # the batch script's EXIT trap: the script ended by itself
        run.exit_code = code
        run.ended_at = self.sim.now
        self.sim.trace.event(self.sim.now, "job", f"job {run.job_id} exits {code} ({why})")
        on_exit(run)
        self.sim.exit(run.process, f"exit code {code}")

    def _report(self, run: JobRun, paths: JobPaths, step: int, metrics: dict[str, float]) -> None:
        line = self._line(step, metrics)
        points = [(key, float(value), step) for key, value in metrics.items()]
        whole = True
        if self.sim.choices.chance(self.program.torn_appends):
            whole = self._append_slowly(run, paths.metrics, line)
        else:
            files.append_line_durably(paths.metrics, line)
        if paths.metrics.parent == run.job_dir:
            record = self.appended if whole else self.torn
            record.setdefault(run.job_dir, []).extend(points)
        if run.orphaned_at is not None:
            self.late_reports.setdefault(run.job_dir, []).extend(points)
        if self.on_report is not None:
            self.on_report(run, step, metrics)
        self.sim.changed(str(run.job_dir))  # what its driver's next look reads

    def _line(self, step: int, metrics: dict[str, float]) -> str:
        return json.dumps(
            {"step": step, "metrics": metrics, "time": self.sim.now + self.sim.process.host.skew_s}
        )

    def _append_slowly(self, run: JobRun, path: Path, line: str) -> bool:
        """``append_line_durably``'s bytes in two writes, a pause between them (where readers meet
        half a line, and a kill leaves it torn); whether the line ended whole (no other run of the job
        dir appended in the pause, as an orphaned run may)."""
        payload = _payload(path, line)
        cut = self.sim.choices.integer(1, len(payload) - 2)
        end = _append_raw(path, payload[:cut])
        self.sim.sleep(self.program.step_s / 4)
        whole = path.stat().st_size == end
        _append_raw(path, payload[cut:])
        return whole

    def _tear(self, run: JobRun, paths: JobPaths, step: int, params: dict[str, float]) -> None:
        """A crash in the middle of an append: part of the report's line, without its newline."""
        metrics = self._metrics(params, step)
        payload = _payload(paths.metrics, self._line(step, metrics))
        _append_raw(paths.metrics, payload[: self.sim.choices.integer(1, len(payload) - 2)])
        if paths.metrics.parent == run.job_dir:
            self.torn.setdefault(run.job_dir, []).extend((key, value, step) for key, value in metrics.items())
        self.sim.trace.event(self.sim.now, "fault", f"job {run.job_id} dies mid-append at step {step}")

    def _heartbeats(self, run: JobRun, paths: JobPaths) -> None:
        while True:
            self.sim.sleep(HEARTBEAT_S)
            self._beat(run, paths, step=self._last_step(paths))

    def _beat(self, run: JobRun, paths: JobPaths, *, step: int | None, finished: bool = False) -> None:
        if run.beat_lock is None:
            run.beat_lock = SimLock(self.sim)
        with run.beat_lock:
            if not run.beats_over:
                self._write_beat(run, paths, step=step, finished=finished)
                run.beats_over = finished

    def _write_beat(self, run: JobRun, paths: JobPaths, *, step: int | None, finished: bool) -> None:
        now = self._now(run)
        started = run.workers_started_at if run.workers_started_at is not None else run.started_at
        beat = RankProgress(
            rank=0,
            host=run.process.host.name,
            pid=run.process.pid + 100000 * run.generation,  # a restarted worker is a new process
            started_at=self._wall(run, started),
            beat_at=now,
            advanced_at=self._wall(run, run.last_progress_at),
            step=step,
            interval_s=HEARTBEAT_S,
            finished=finished,
            stop_signal="SIGTERM" if run.preempted_at is not None else None,
            stop_requested_at=None if run.preempted_at is None else self._wall(run, run.preempted_at),
            # As the runtime measures them: on the monotonic clock, which no jump moves.
            idle_s=self.sim.now - run.last_progress_at,
            ran_s=self.sim.now - started,
        )
        record = asdict(beat)
        del record["telemetry"]
        # As the runtime's heartbeat thread: a write that fails (a new attempt's submit clearing the
        # folder under an orphaned run) is a missed beat, never the end of training.
        with contextlib.suppress(OSError):
            write_bytes_atomic(paths.progress / "rank-0.json", json.dumps(record).encode())
        if run.placement is not None and run.placement.elastic:
            self._write_peer_beats(run, paths, record)

    def _write_peer_beats(self, run: JobRun, paths: JobPaths, record: dict[str, Any]) -> None:
        """An elastic run's other ranks (one per node of its group) beat as rank 0 does: the watchdog
        then sees a lost node's rank stop beating, until rank 0 of the next group forgets it."""
        for rank, node in enumerate(run.group[1:], start=1):
            peer = {**record, "rank": rank, "host": node, "pid": 4000 + rank + 100 * run.generation}
            with contextlib.suppress(OSError):
                write_bytes_atomic(paths.progress / f"rank-{rank}.json", json.dumps(peer).encode())

    def _last_step(self, paths: JobPaths) -> int | None:
        latest = latest_checkpoint(paths.checkpoints)
        return latest.step if latest is not None else None

    def _now(self, run: JobRun) -> float:
        return self.sim.now + run.process.host.skew_s

    def _wall(self, run: JobRun, moment: float) -> float:
        """The wall-clock reading the runtime took at ``moment`` (read now, at its first beat after)."""
        return run.wall_readings.setdefault(moment, moment + run.process.host.skew_s)


def checkpoint_state(run: JobRun, step: int, params: dict[str, float]) -> bytes:
    """A checkpoint that says where it was trained (its trial's job dir), at which step, with which
    parameters: what a run resumes from can be told apart from a copy of another trial's."""
    return json.dumps({"trial": run.job_dir.name, "step": step, "params": params}, sort_keys=True).encode()


def score(params: dict[str, float], step: int) -> float:
    """The objective at ``step``: rises with the step, higher for a higher ``x``."""
    return round(params.get("x", 0.5) * (1.0 - 0.5 ** (step + 1)), 6)


def cost(params: dict[str, float], step: int) -> float:
    """A second objective (to minimize), at odds with ``score``: higher for a higher ``x``."""
    return round(params.get("x", 0.5) ** 2 + 0.1 * 0.5 ** (step + 1), 6)


OBJECTIVES: dict[str, Callable[[dict[str, float], int], float]] = {"score": score, "cost": cost}
"""What the program can report, by metric name."""
FINAL_BONUS = 0.001
"""What the final evaluation (the result file) adds to each metric's last report."""


def _payload(path: Path, line: str) -> bytes:
    """The bytes ``append_line_durably`` writes for ``line``: after a newline where the file ends torn."""
    return (b"\n" if _ends_torn(path) else b"") + line.encode() + b"\n"


def _ends_torn(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            if size == 0:
                return False
            handle.seek(size - 1)
            return handle.read(1) != b"\n"
    except FileNotFoundError:
        return False


def _append_raw(path: Path, data: bytes) -> int:
    """Append ``data`` as one write; the file's size after it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as handle:
        handle.write(data)
        return handle.tell()
