"""A seed's scenario: the study, the cluster, the training program, and the faults, drawn from the seed.

Faults come in two kinds. *Rates* apply at every boundary call while the fault phase lasts (a store
call failing before or after it commits, a backend command timing out or losing its reply, a job
crashing, hanging or being preempted at a step, a job slow to start up or never starting, a Slurm
requeue, a Slurm node that stops answering or is set DOWN).
*Timed faults* strike once, at a time of the fault phase: an orchestrator killed (SIGKILL), stalled
past its lease TTL, its host's clock jumping, a second orchestrator started beside the first. *Faults
at any yield point* strike an orchestrator where its thread stopped, a lock or a lease's fence held or
not: a SIGKILL, a stall (short, or past the lease TTL), its host's clock jumping; and a job's training
process may stall there too. After ``fault_phase_s`` every fault stops, and the study must then end
(liveness) within ``settle_s``. Draws added later (ASHA, PBT, crashes after writes, node failures,
start-ups, preemptions, the train and evaluate steps, time, PBT's slow checkpoint copies, elastic
trials and the memory tier) come from
random sources of their own, so a seed's earlier draws stay as they were.

Time passes: each seed draws a *latency profile* (``scheduler.Latency``), how long each kind of call
takes (Optuna, MLflow, a backend's API, a local syscall, a record written, a job's process starting):
instant in some seeds (every interleaving within one instant), slow in others.

The program and the study vary too, each drawn apart from the rest (a ``random.Random`` of its own
per seed, so every other draw of a seed stays what it was): a job of a thousand steps and more
reporting every few steps, slow appends of the metrics file (torn lines), two objectives, enqueued
configurations, and TPE in place of random sampling.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from simulation.backends import KINDS, BackendSettings, draws, rate
from simulation.backends.slurm import SlurmSettings, with_node_failures
from simulation.cluster import JobFaults, Program
from simulation.scheduler import Latency, Span
from simulation.stores import Faults


@dataclass(frozen=True)
class TimedFault:
    at: float
    """Seconds after the start."""
    kind: str
    """``kill``, ``stall``, ``clock_jump``, ``second_orchestrator``."""
    seconds: float = 0.0
    """How long a stall lasts, or how far a clock jumps (negative: back)."""

    def describe(self) -> str:
        if self.kind == "stall":
            return f"{self.at:.0f}s: an orchestrator stalls {self.seconds:.0f}s"
        if self.kind == "clock_jump":
            return f"{self.at:.0f}s: the orchestrators' host clock jumps {self.seconds:+.0f}s"
        return f"{self.at:.0f}s: {self.kind.replace('_', ' ')}"


@dataclass(frozen=True)
class Scenario:
    seed: int
    backend: BackendSettings
    """The launcher kind, its simulated cluster's settings and faults."""
    num_trials: int
    num_parallel: int
    max_restarts: int
    pruner: str
    timeout_s: float | None
    hang_timeout_s: float | None
    poll_s: float
    program: Program
    optuna_writes: Faults = field(default_factory=Faults)
    optuna_reads: Faults = field(default_factory=Faults)
    mlflow: Faults = field(default_factory=Faults)
    jobs: JobFaults = field(default_factory=JobFaults)
    timed: tuple[TimedFault, ...] = field(default_factory=tuple)
    fault_phase_s: float = 600.0
    settle_s: float = 7200.0
    disk_full_per_write: float = 0.0
    """The chance an orchestrator's record write fails on a full filesystem (ENOSPC)."""
    crash_per_step: float = 0.0
    """The chance an orchestrator is SIGKILLed at any one of its yield points (a crash anywhere)."""
    crash_after_write: float = 0.0
    """The chance an orchestrator is SIGKILLed just after one of its Optuna writes commits: a crash
    aimed at the windows between two writes of one transition, where exactly-once is won or lost."""
    two_hosts: bool = False
    """Orchestrators alternate between two hosts (their pids cannot be looked up across them)."""
    num_nodes: int = 1
    """Nodes per job (``resources.num_nodes``): drawn for Slurm's seeds, whose twin allocates them."""
    min_nodes: int | None = None
    """``resources.min_nodes`` below ``num_nodes``: elastic trials, whose group goes on without a
    lost node that is not its first (Slurm's seeds)."""
    checkpoint_tiers: tuple[int, int] | None = None
    """``train.checkpoints``' ``(memory_every_steps, shared_every_steps)``: the memory tier (Slurm's
    seeds without PBT); None: every save goes to the shared file system."""
    startup_timeout_s: float | None = 1800.0
    """``train.startup_timeout_s``: how long a running job may take to send its first heartbeat."""
    steps: tuple[str, ...] = ()
    """The pipeline's train and evaluate steps run beside the tune step (``simulation.steps``)."""
    latency: Latency = field(default_factory=Latency)
    """How long each kind of call takes (see the module docstring)."""
    stall_per_step: float = 0.0
    """The chance an orchestrator stalls at any one of its yield points (short, or past the lease TTL)."""
    clock_jump_per_step: float = 0.0
    """The chance an orchestrator's host clock jumps (forward or back) at any one of its yield points."""
    job_stall_per_step: float = 0.0
    """The chance a job's training process stalls a while at any one of its yield points."""
    objectives: tuple[tuple[str, str], ...] = (("score", "maximize"),)
    """The study's objectives, (metric, direction), primary first: two make it multi-objective."""
    enqueue: tuple[float, ...] = ()
    """Values of ``x`` the spec enqueues (``TuneSettings.enqueue``): each must run once, first."""
    sampler: str = "random"
    """The study's sampler kind."""

    rungs_mid_sleep: bool = False
    """ASHA's rungs placed inside a sleep's reports rather than at its start (a long program's: a
    batch of reports crosses a rung while Optuna was last told a step before it)."""

    lost_pause_answers: float = 0.0
    """The chance the answer of a write of a trial's ASHA state (a pause, a promotion) is lost after it
    committed: its writer retries while the orchestrator's other threads already see the new state."""

    def quiet(self) -> Scenario:
        """The same study and cluster without any fault (for a run's baseline)."""
        return replace(
            self,
            optuna_writes=Faults(),
            optuna_reads=Faults(),
            mlflow=Faults(),
            backend=self.backend.quiet(),
            jobs=JobFaults(),
            timed=(),
            crash_per_step=0.0,
            crash_after_write=0.0,
            lost_pause_answers=0.0,
            disk_full_per_write=0.0,
            stall_per_step=0.0,
            clock_jump_per_step=0.0,
            job_stall_per_step=0.0,
        )

    def _describe_program(self) -> str:
        program = self.program
        return (
            f"program: {program.steps} steps, a report every {program.stride}, "
            f"{program.reports_per_sleep} report(s) in each sleep of {program.step_s:.0f}s, metrics "
            f"{', '.join(program.metrics)}, "
            f"{'a result file' if program.writes_result else 'exit 0 without a result file'}, "
            f"same-step reports {program.same_step_reports}, slow (tearable) appends {program.torn_appends}, "
            f"keeps {program.keep} checkpoint(s)"
        )

    def _describe_elastic(self) -> str:
        text = f" (elastic down to {self.min_nodes})" if self.min_nodes is not None else ""
        if self.checkpoint_tiers is not None:
            memory, shared = self.checkpoint_tiers
            text += f", checkpoints to memory every {memory} steps, to the shared file system every {shared}"
        return text

    def _describe_study(self) -> str:
        objectives = ", ".join(f"{metric} ({direction})" for metric, direction in self.objectives)
        enqueued = ", ".join(f"x={x}" for x in self.enqueue) or "nothing"
        return f"study: {objectives}, sampler {self.sampler}, enqueues {enqueued}"

    def describe(self) -> str:
        lines = [
            f"seed {self.seed}: {self.backend.kind}, {self.num_trials} trials, "
            f"{self.num_parallel} in parallel, "
            f"max_restarts {self.max_restarts}, pruner {self.pruner}, timeout {self.timeout_s}, "
            f"hang timeout {self.hang_timeout_s}, orchestrators on {2 if self.two_hosts else 1} host(s), "
            f"{self.num_nodes} node(s) per job{self._describe_elastic()}",
            self._describe_program(),
            self._describe_study(),
            f"rates: optuna writes {self.optuna_writes}, reads {self.optuna_reads}, mlflow {self.mlflow}, "
            f"jobs {self.jobs}",
            self.backend.describe(),
        ]
        if self.disk_full_per_write:
            chance = f"{self.disk_full_per_write:.3f}"
            lines.append(f"an orchestrator's record write meets a full disk with probability {chance}")
        if self.crash_per_step:
            lines.append(
                f"an orchestrator crashes at any yield point with probability {self.crash_per_step:.4f}"
            )
        if self.rungs_mid_sleep:
            lines.append("ASHA's rungs lie inside a sleep's reports")
        if self.lost_pause_answers:
            lines.append(
                f"an ASHA state write's answer is lost with probability {self.lost_pause_answers:.3f}"
            )
        if self.crash_after_write:
            lines.append(
                f"an orchestrator crashes just after an Optuna write commits with probability "
                f"{self.crash_after_write:.3f}"
            )
        if self.startup_timeout_s != 1800.0:
            lines.append(f"start-up timeout {self.startup_timeout_s:.0f}s")
        if self.steps:
            lines.append(f"steps beside the tune step: {', '.join(self.steps)}")
        lines += self._describe_time()
        lines += [f"timed: {fault.describe()}" for fault in self.timed]
        return "\n".join(lines)

    def _describe_time(self) -> list[str]:
        """The latency profile and the faults at any yield point besides a crash."""
        lines = [self.latency.describe()]
        at_any_point = (
            ("an orchestrator stalls", self.stall_per_step),
            ("an orchestrator's host clock jumps", self.clock_jump_per_step),
            ("a job's process stalls", self.job_stall_per_step),
        )
        lines += [
            f"{what} at any yield point with probability {chance:.4f}"
            for what, chance in at_any_point
            if chance
        ]
        return lines


def scenario_of(seed: int, *, kinds: tuple[str, ...] = KINDS) -> Scenario:
    """The scenario of ``seed`` (the same seed, the same scenario, on every machine), on one of the
    backends ``kinds``."""
    draw = random.Random(f"scenario-{seed}")
    backend = draws()[draw.choice(kinds)](draw)
    program = Program(
        steps=draw.randint(2, 6),
        step_s=draw.choice([5.0, 10.0, 30.0]),
        same_step_reports=draw.choice([0.0, 0.3]),
        writes_result=draw.random() < 0.7,
    )
    run_s = program.steps * program.step_s
    timeout_s = draw.choice([None, run_s * 3 + 120.0])
    hang_timeout_s = draw.choice([None, 60.0 + 2 * program.step_s])
    fault_phase_s = draw.uniform(200.0, 900.0)
    timed = tuple(sorted(_timed_faults(draw, fault_phase_s), key=lambda fault: fault.at))
    scenario = Scenario(
        seed=seed,
        backend=backend,
        num_trials=draw.randint(2, 6),
        num_parallel=draw.randint(1, 3),
        max_restarts=draw.randint(0, 2),
        pruner=draw.choice(["none", "median", "threshold"]),
        timeout_s=timeout_s,
        hang_timeout_s=hang_timeout_s,
        poll_s=draw.choice([1.0, 5.0]),
        program=program,
        optuna_writes=Faults(before=rate(draw, 0.05), after=rate(draw, 0.05)),
        optuna_reads=Faults(before=rate(draw, 0.02)),
        mlflow=Faults(before=rate(draw, 0.2), after=rate(draw, 0.1)),
        # A hang ends only where something watches for it: a hang timeout, or a run-time limit.
        jobs=JobFaults(crash=rate(draw, 0.1), hang=rate(draw, 0.05) if timeout_s or hang_timeout_s else 0.0),
        timed=timed,
        fault_phase_s=fault_phase_s,
        crash_per_step=rate(draw, 0.002),
        disk_full_per_write=rate(draw, 0.02),
        # The local launcher's jobs are processes of one machine, the orchestrators' own.
        two_hosts=backend.kind != "local" and draw.random() < 0.5,
    )
    scenario = _with_node_failures(_with_crashes_after_writes(_with_pbt(_with_asha(scenario))))
    scenario = _with_lost_pause_answers(scenario)
    scenario = _with_time(_with_steps(_with_preemptions(_with_slow_starts(scenario))))
    scenario = _with_enqueue(_with_objectives(_with_torn_appends(_with_long_program(scenario))))
    return _with_node_memory(_with_slow_copies(_with_rungs_mid_sleep(_with_sampler(scenario))))


def _with_asha(scenario: Scenario) -> Scenario:
    """ASHA (pause and promote) in place of no pruner in some seeds, drawn apart so that every other
    draw of a seed stays what it was before ASHA existed (the seeds each mutant is known by). In half
    of them jobs crash more often: a promoted trial's job that fails spends its restarts, and leaders
    that fail before any trial completes leave ASHA's end of the study only paused trials to resume."""
    draw = random.Random(f"asha-{scenario.seed}")
    if scenario.pruner != "none" or draw.random() >= 0.5:
        return scenario
    if draw.random() < 0.5:
        return replace(scenario, pruner="asha")
    crash = max(scenario.jobs.crash, draw.uniform(0.05, 0.2))
    num_trials = max(scenario.num_trials, draw.randint(4, 8))
    return replace(scenario, pruner="asha", num_trials=num_trials, jobs=replace(scenario.jobs, crash=crash))


def _with_pbt(scenario: Scenario) -> Scenario:
    """Population-based training in place of no pruner in some of the seeds ASHA left alone (drawn
    apart, as ASHA's), where the orchestrator reads the jobs' checkpoints (not SageMaker's, which sync
    to S3): a population of ``num_parallel`` (at least 2), which is then the study's trials."""
    if scenario.pruner != "none" or scenario.backend.kind == "sagemaker":
        return scenario
    if random.Random(f"pbt-{scenario.seed}").random() >= 0.5:
        return scenario
    population = max(2, scenario.num_parallel)
    return replace(scenario, pruner="pbt", num_parallel=population, num_trials=population)


def _with_lost_pause_answers(scenario: Scenario) -> Scenario:
    """ASHA's seeds, in half of them: lost answers aimed at the writes of a trial's pause state, drawn
    apart (as ASHA's). A trial's driver then retries its pause while the loop sees the trial paused and
    may promote it: the window where two threads of one orchestrator met inside one trial's fence."""
    draw = random.Random(f"lost-pause-answers-{scenario.seed}")
    if scenario.pruner != "asha":
        return scenario
    return replace(scenario, lost_pause_answers=rate(draw, 0.5))


def _with_crashes_after_writes(scenario: Scenario) -> Scenario:
    """Crashes just after a write in about half the seeds, drawn apart (as ASHA's), so that every
    other draw of a seed stays what it was before. A crash at a yield point drawn uniformly lands
    between two writes of one transition (PBT's continuation created, the trial it replaces not yet
    PRUNED) in about one seed of a thousand; this, in ten."""
    draw = random.Random(f"crash-after-write-{scenario.seed}")
    return replace(scenario, crash_after_write=rate(draw, 0.1))


def _with_node_failures(scenario: Scenario) -> Scenario:
    """Slurm's seeds: nodes that stop answering or are set DOWN, and jobs of one or two nodes, drawn
    apart (as ASHA's)."""
    if not isinstance(scenario.backend, SlurmSettings):
        return scenario
    draw = random.Random(f"node-failures-{scenario.seed}")
    backend = with_node_failures(scenario.backend, draw)
    return replace(scenario, backend=backend, num_nodes=draw.choice([1, 1, 2]))


def _with_node_memory(scenario: Scenario) -> Scenario:
    """Slurm's seeds, drawn apart (as ASHA's): elastic trials (down to one node) in half of the
    two-node seeds and in a quarter of the one-node ones, which then run on two; and the memory tier
    in half of the seeds without PBT (whose donors the orchestrator reads from the shared file system
    alone), with a memory save at each of the program's saves and a shared one every one to three.
    Elastic seeds lose nodes more often, and without a run-time limit their jobs train longer (6 to
    12 sleeps): a loss while a job runs, and the hang timeout passing after it, is what they are about."""
    if scenario.backend.kind != "slurm":
        return scenario
    draw = random.Random(f"node-memory-{scenario.seed}")
    if draw.random() < (0.5 if scenario.num_nodes == 2 else 0.25):
        backend = _losing_nodes(scenario.backend, draw)
        scenario = replace(
            scenario, num_nodes=2, min_nodes=1, backend=backend, program=_longer(scenario, draw)
        )
    if scenario.pruner == "pbt" or draw.random() >= 0.5:
        return scenario
    every = scenario.program.sleep_steps
    return replace(scenario, checkpoint_tiers=(every, every * draw.choice([1, 2, 3])))


def _longer(scenario: Scenario, draw: random.Random) -> Program:
    program = scenario.program
    if scenario.timeout_s is not None or program.stride != 1:
        return program  # the limit was drawn from the run time; a long program has its sleeps already
    return replace(program, steps=max(program.steps, draw.randint(6, 12)))


def _losing_nodes(backend: BackendSettings, draw: random.Random) -> BackendSettings:
    assert isinstance(backend, SlurmSettings)
    failures = max(backend.faults.node_failure_per_s, draw.uniform(0.001, 0.006))
    return replace(backend, faults=replace(backend.faults, node_failure_per_s=failures))


_SLOWEST: dict[str, Span] = {
    # A seed's slowest call of each kind lies between these (log-uniformly); its fastest is a tenth.
    "optuna": (0.001, 0.05),  # a local SQLite file .. a busy PostgreSQL server across a region
    "mlflow": (0.01, 0.5),  # a tracking server next door .. one under a backlog of batches
    "api": (0.02, 3.0),  # an idle slurmctld or AWS endpoint .. a loaded one (squeue over 10k jobs)
    "syscall": (0.0001, 0.05),  # an idle machine .. one whose cores the jobs keep busy
    "write": (0.0005, 0.02),  # a local disk .. an fsync on Lustre
    "process_start": (0.1, 5.0),  # a bare interpreter .. importing torch and CUDA's setup
}


def _with_time(scenario: Scenario) -> Scenario:
    """Time that passes (a latency profile) and faults at any yield point, drawn apart (as ASHA's)."""
    draw = random.Random(f"time-{scenario.seed}")
    return replace(
        scenario,
        latency=_latency(draw),
        stall_per_step=rate(draw, 0.004),
        clock_jump_per_step=rate(draw, 0.001),
        job_stall_per_step=rate(draw, 0.004),
    )


def _latency(draw: random.Random) -> Latency:
    """Instant in a fifth of the seeds (as before calls took time); else each kind of call somewhere
    between fast and slow, independently."""
    if draw.random() < 0.2:
        return Latency()
    spans = {}
    for kind, (fast, slow) in _SLOWEST.items():
        slowest = fast * (slow / fast) ** draw.random()
        spans[kind] = (slowest / 10, slowest)
    return Latency(**spans)


def _with_long_program(scenario: Scenario) -> Scenario:
    """A program of a thousand steps and more in about a quarter of the seeds, drawn apart (as
    ASHA's): a report every few steps (a stride of 3 to 9, past step 1,000 Optuna is told only some;
    of 25, every one), as many sleeps as the program drawn first (so its run time, the time limits
    drawn from it, and the seed's simulated time stay what they were), each several reports long."""
    draw = random.Random(f"long-program-{scenario.seed}")
    if draw.random() >= 0.25:
        return scenario
    program = scenario.program
    stride = draw.choice([3, 7, 9, 25])
    points = draw.randint(1100, 2400) // stride + 1
    long = replace(
        program,
        steps=(points - 1) * stride + 1,
        stride=stride,
        reports_per_sleep=-(-points // program.steps),
    )
    return replace(scenario, program=long)


def _with_slow_copies(scenario: Scenario) -> Scenario:
    """PBT's seeds, in half of them: each file of a copied checkpoint step takes a while (up to one
    or two of the program's sleeps, as a large state does), and jobs keep one or two checkpoints,
    drawn apart (as ASHA's). An exploited member then copies a donor's newest step while the donor's
    job trains on, saves and prunes, so the step may be pruned under the copy, between two of its
    files. Elsewhere a copy is instant and no yield point, as it was before."""
    if scenario.pruner != "pbt":
        return scenario
    draw = random.Random(f"slow-copies-{scenario.seed}")
    if draw.random() >= 0.5:
        return scenario
    slowest = scenario.program.step_s * draw.uniform(0.3, 2.0)
    latency = replace(scenario.latency, copy=(slowest / 10, slowest))
    program = replace(scenario.program, keep=draw.choice([1, 2]))
    return replace(scenario, latency=latency, program=program)


def _with_rungs_mid_sleep(scenario: Scenario) -> Scenario:
    """ASHA's seeds with a long program of three sleeps or more, in half of them: the first rung at
    the last report of a sleep (the second), drawn apart (as ASHA's). Where a rung starts a sleep, as
    elsewhere, the batch's first report reaches it and is told; at a batch's end, past step 1,000, the
    batch may reach it with Optuna last told a step before it."""
    if scenario.pruner != "asha" or scenario.program.stride == 1 or scenario.program.sleeps < 3:
        return scenario
    if random.Random(f"rungs-mid-sleep-{scenario.seed}").random() >= 0.5:
        return scenario
    return replace(scenario, rungs_mid_sleep=True)


def _with_torn_appends(scenario: Scenario) -> Scenario:
    """Slow appends of the metrics file in about a third of the seeds, drawn apart (as ASHA's): a
    reader meets half-written lines, and a run killed or crashed mid-append leaves a torn one."""
    draw = random.Random(f"torn-appends-{scenario.seed}")
    if draw.random() >= 0.35:
        return scenario
    chance = draw.choice([0.05, 0.3]) if scenario.program.stride == 1 else draw.choice([0.002, 0.01])
    return replace(scenario, program=replace(scenario.program, torn_appends=chance))


def _with_objectives(scenario: Scenario) -> Scenario:
    """Two objectives (score up, cost down) in most seeds without a pruner and a few with the median or
    threshold pruner, which then have none (every pruner refuses several objectives, PBT too), drawn
    apart (as ASHA's); the program then reports both."""
    draw = random.Random(f"objectives-{scenario.seed}")
    chance = {"none": 0.6, "median": 0.15, "threshold": 0.15}.get(scenario.pruner, 0.0)
    if draw.random() >= chance:
        return scenario
    objectives = (("score", "maximize"), ("cost", "minimize"))
    program = replace(scenario.program, metrics=tuple(metric for metric, _ in objectives))
    return replace(scenario, objectives=objectives, program=program, pruner="none")


def _with_enqueue(scenario: Scenario) -> Scenario:
    """One to three known configurations enqueued (no more than the study's trials) in about a third
    of the seeds, drawn apart (as ASHA's); in half of those a second orchestrator starts together with
    the first, so that both enqueue at once (where only the study lock keeps each configuration once)."""
    draw = random.Random(f"enqueue-{scenario.seed}")
    if draw.random() >= 0.35:
        return scenario
    count = draw.randint(1, min(3, scenario.num_trials))
    values = tuple(sorted({round(draw.uniform(0.0, 1.0), 3) for _ in range(count)}))
    timed = scenario.timed
    if draw.random() < 0.5:
        timed = (TimedFault(0.0, "second_orchestrator"), *timed)
    return replace(scenario, enqueue=values, timed=timed)


def _with_sampler(scenario: Scenario) -> Scenario:
    """TPE (multivariate, the constant liar) in place of random sampling in about a third of the
    seeds, drawn apart (as ASHA's)."""
    draw = random.Random(f"sampler-{scenario.seed}")
    return replace(scenario, sampler="tpe") if draw.random() < 0.35 else scenario


def _timed_faults(draw: random.Random, phase_s: float) -> list[TimedFault]:
    """Kills, stalls (some past the lease TTL), clock jumps and second orchestrators, each kind in
    about half the seeds, several of a kind in some."""
    faults = []
    if draw.random() < 0.4:
        faults.append(TimedFault(draw.uniform(0.0, min(60.0, phase_s)), "second_orchestrator"))
    counts = {
        kind: draw.choice([0, 0, 1, 2, 3]) for kind in ("kill", "stall", "clock_jump", "second_orchestrator")
    }
    for kind, count in counts.items():
        for _ in range(count):
            seconds = 0.0
            if kind == "stall":
                seconds = draw.uniform(5.0, 240.0)
            elif kind == "clock_jump":
                seconds = draw.choice([-1, 1]) * draw.uniform(1.0, 300.0)
            faults.append(TimedFault(draw.uniform(0.0, phase_s), kind, seconds))
    return faults


def _with_slow_starts(scenario: Scenario) -> Scenario:
    """A start-up timeout in about half the seeds, drawn apart (as ASHA's), with jobs whose first
    heartbeat comes late (up to twice the timeout: some are stopped as hung, some not) and jobs that
    never send one."""
    draw = random.Random(f"start-up-{scenario.seed}")
    if draw.random() >= 0.5:
        return scenario
    startup_timeout_s = draw.uniform(20.0, 90.0)
    jobs = replace(
        scenario.jobs,
        slow_start=rate(draw, 0.6),
        slow_start_s=2 * startup_timeout_s,
        never_starts=rate(draw, 0.1),
    )
    return replace(scenario, startup_timeout_s=startup_timeout_s, jobs=jobs)


def _with_preemptions(scenario: Scenario) -> Scenario:
    """Preemptions (a stop signal the script saves and exits 0 on) in about half the seeds without a
    run-time limit, drawn apart: with a limit, a signal near it is the limit's warning (timed out)."""
    if scenario.timeout_s is not None:
        return scenario
    draw = random.Random(f"preemption-{scenario.seed}")
    return replace(scenario, jobs=replace(scenario.jobs, preempt=rate(draw, 0.2)))


def _with_steps(scenario: Scenario) -> Scenario:
    """A train step, and in half of those an evaluate step after it, beside the tune step in about a
    third of the seeds, drawn apart. Not SageMaker's: its twin finds a job's dir from its checkpoint
    folder, which for an evaluation is the trained job's."""
    if scenario.backend.kind == "sagemaker":
        return scenario
    draw = random.Random(f"steps-{scenario.seed}")
    if draw.random() >= 1 / 3:
        return scenario
    return replace(scenario, steps=("train", "evaluate") if draw.random() < 0.5 else ("train",))
