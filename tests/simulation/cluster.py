"""What a trial's job does once a backend runs it, and what the backends know for the invariants.

A job is a simulated process running the *training program*: it resumes from its newest checkpoint,
then for each step sleeps the step's time, reports (sometimes twice at one step), saves a checkpoint
and advances its heartbeat, and at the end writes its result file and exits 0. It writes the very
files a real job writes (``tunepod.runtime``'s formats: the metrics file, ``step-N`` checkpoints, the
heartbeat, the result file), on its node's clock, so the real orchestrator reads real job dirs. While
faults are on, the program may crash (exit 1) or hang (its loop stops advancing, its heartbeat goes
on) at a step, as the scenario's rates say.

``Cluster`` is the ground truth the invariants read: every job run, when it started and ended, on
whose request, whether it is hung, the requests to stop it with the reason its job dir gave, every
checkpoint a run saved, and the node failures that struck runs. A run its backend gave up on (its
node stopped answering: the job went on without it) is *orphaned*: it no longer counts as its job's
live run, though its processes may train on until they are killed.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from simulation.scheduler import Host, Process, Scheduler
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_cancel_marker
from tunepod.runtime.checkpoints import latest_checkpoint, read_whole_state, save_checkpoint
from tunepod.runtime.files import append_line_durably, write_bytes_atomic
from tunepod.runtime.progress import RankProgress

HEARTBEAT_S = 10.0
ExitHook = Callable[["JobRun"], None]
"""Called when a run's program exits by itself: the backend records the outcome."""


@dataclass(frozen=True)
class JobFaults:
    """Per step of a job, while faults are on: the chance it crashes, and that it hangs."""

    crash: float = 0.0
    hang: float = 0.0


@dataclass(frozen=True)
class Program:
    """The training every trial runs: ``steps`` steps of ``step_s`` seconds."""

    steps: int
    step_s: float
    same_step_reports: float = 0.0
    """The chance a step reports a second metric in a second line (one step, two reports)."""
    writes_result: bool = True
    """Whether the script ends with ``ctx.finish`` (a result file); without, it just exits 0."""


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
    resumed_from: dict[str, object] | None = None
    """What the checkpoint it resumed from says of itself (``checkpoint_state``); None without one."""


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
    runs: list[JobRun] = field(default_factory=list)
    stops: list[StopRequest] = field(default_factory=list)
    created: dict[Path, int] = field(default_factory=dict)
    """Jobs ever created per job dir (a backend's count, for the trace)."""
    saves: dict[Path, list[int]] = field(default_factory=dict)
    """Every checkpoint step saved per job dir, in order (a step saved again is listed again)."""
    node_failures: list[NodeFailure] = field(default_factory=list)
    late_reports: dict[Path, list[tuple[str, float, int]]] = field(default_factory=dict)
    """Per job dir, what orphaned runs reported (key, value, step) after they were orphaned."""

    def live_runs(self, job_dir: Path) -> list[JobRun]:
        """The runs its backend counts as its jobs' (an orphaned run may live on, lost to it)."""
        return [
            run
            for run in self.runs
            if run.job_dir == job_dir and run.ended_at is None and run.orphaned_at is None
        ]

    def newest_saved(self, job_dir: Path) -> int | None:
        return max(self.saves.get(job_dir, []), default=None)

    def start(
        self,
        job_dir: Path,
        job_id: str,
        env: Mapping[str, str],
        node: Host,
        on_exit: ExitHook,
        *,
        paths: JobPaths | None = None,
    ) -> JobRun:
        """Start a run of a job with environment ``env`` on ``node``; ``on_exit(run)`` once its
        program ends by itself (not when it is killed). ``paths``: where the program writes its
        reports, heartbeats, checkpoints and result (default: ``job_dir``'s; a backend whose jobs
        write elsewhere, such as SageMaker without a writable FSx, says where)."""
        process = self.sim.start_process(f"job {job_id}", node)
        attempt_key = env.get("TUNEPOD_SUBMISSION_ID", "")
        run = JobRun(job_dir, job_id, attempt_key, self.sim.now, process, last_progress_at=self.sim.now)
        self.runs.append(run)
        self.sim.trace.event(self.sim.now, "job", f"job {job_id} runs ({job_dir.name})")
        params = dict(json.loads(env.get("TUNEPOD_PARAMS", "{}")))
        writes = paths if paths is not None else JobPaths(job_dir)
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

    def stop_requested(self, job_dir: Path, job_id: str) -> None:
        marker = read_cancel_marker(JobPaths(job_dir))
        reason = marker.reason if marker is not None else None
        self.stops.append(StopRequest(self.sim.now, job_dir, job_id, self.sim.process.name, reason))

    # ------------------------------------------------------------------------------ the program

    def _train(self, run: JobRun, paths: JobPaths, params: dict[str, float], on_exit: ExitHook) -> None:
        sim = self.sim
        latest = latest_checkpoint(paths.checkpoints)
        step = latest.step + 1 if latest is not None else 0
        run.first_step, run.newest_saved = step, self.newest_saved(run.job_dir)
        run.resumed_from = json.loads(read_whole_state(latest)) if latest is not None else None
        self._beat(run, paths, step=None)
        run.process.spawn("heartbeat", lambda: self._heartbeats(run, paths))
        while step < self.program.steps:
            sim.sleep(self.program.step_s)
            if self.faults_on and sim.choices.chance(self.faults.crash):
                self._exit(run, 1, on_exit, f"crashed at step {step}")
                return
            if run.stuck or (self.faults_on and sim.choices.chance(self.faults.hang)):
                run.hung = True
                sim.trace.event(sim.now, "fault", f"job {run.job_id} hangs at step {step}")
                sim.block(None, "hung")  # forever: only a kill ends it
            self._report(run, paths, step, {"score": score(params, step)})
            if sim.choices.chance(self.program.same_step_reports):
                self._report(run, paths, step, {"loss": round(1.0 - score(params, step), 6)})
            save_checkpoint(paths.checkpoints, checkpoint_state(run, step, params), step, keep=2)
            if paths.checkpoints.parent == run.job_dir:
                self.saves.setdefault(run.job_dir, []).append(step)
            run.last_progress_at = sim.now
            self._beat(run, paths, step=step)
            step += 1
        if self.program.writes_result:
            self._finish(run, paths, params, step - 1)
        self._beat(run, paths, step=step - 1, finished=True)
        self._exit(run, 0, on_exit, "finished")

    def _finish(self, run: JobRun, paths: JobPaths, params: dict[str, float], step: int) -> None:
        write_bytes_atomic(
            paths.result,
            json.dumps(
                {"metrics": {"score": score(params, step)}, "step": step, "time": self._now(run)}
            ).encode(),
        )
        run.wrote_result = paths.result.parent == run.job_dir
        run.result_at = self.sim.now

    def _exit(self, run: JobRun, code: int, on_exit: ExitHook, why: str) -> None:
        run.exit_code = code
        run.ended_at = self.sim.now
        self.sim.trace.event(self.sim.now, "job", f"job {run.job_id} exits {code} ({why})")
        on_exit(run)
        self.sim.exit(run.process, f"exit code {code}")

    def _report(self, run: JobRun, paths: JobPaths, step: int, metrics: dict[str, float]) -> None:
        line = json.dumps(
            {"step": step, "metrics": metrics, "time": self.sim.now + self.sim.process.host.skew_s}
        )
        append_line_durably(paths.metrics, line)
        if run.orphaned_at is not None:
            late = self.late_reports.setdefault(run.job_dir, [])
            late += [(key, float(value), step) for key, value in metrics.items()]

    def _heartbeats(self, run: JobRun, paths: JobPaths) -> None:
        while True:
            self.sim.sleep(HEARTBEAT_S)
            self._beat(run, paths, step=self._last_step(paths))

    def _beat(self, run: JobRun, paths: JobPaths, *, step: int | None, finished: bool = False) -> None:
        now = self._now(run)
        beat = RankProgress(
            rank=0,
            host=run.process.host.name,
            pid=run.process.pid,
            started_at=run.started_at + run.process.host.skew_s,
            beat_at=now,
            advanced_at=run.last_progress_at + run.process.host.skew_s,
            step=step,
            interval_s=HEARTBEAT_S,
            finished=finished,
        )
        record = asdict(beat)
        del record["telemetry"]
        # As the runtime's heartbeat thread: a write that fails (a new attempt's submit clearing the
        # folder under an orphaned run) is a missed beat, never the end of training.
        with contextlib.suppress(OSError):
            write_bytes_atomic(paths.progress / "rank-0.json", json.dumps(record).encode())

    def _last_step(self, paths: JobPaths) -> int | None:
        latest = latest_checkpoint(paths.checkpoints)
        return latest.step if latest is not None else None

    def _now(self, run: JobRun) -> float:
        return self.sim.now + run.process.host.skew_s


def checkpoint_state(run: JobRun, step: int, params: dict[str, float]) -> bytes:
    """A checkpoint that says where it was trained (its trial's job dir), at which step, with which
    parameters: what a run resumes from can be told apart from a copy of another trial's."""
    return json.dumps({"trial": run.job_dir.name, "step": step, "params": params}, sort_keys=True).encode()


def score(params: dict[str, float], step: int) -> float:
    """The objective at ``step``: rises with the step, higher for a higher ``x``."""
    return round(params.get("x", 0.5) * (1.0 - 0.5 ** (step + 1)), 6)
