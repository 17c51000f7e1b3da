"""A seed's scenario: the study, the cluster, the training program, and the faults, drawn from the seed.

Faults come in two kinds. *Rates* apply at every boundary call while the fault phase lasts (a store
call failing before or after it commits, a backend command timing out or losing its reply, a job
crashing or hanging at a step, a Slurm requeue, a Slurm node that stops answering or is set DOWN).
*Timed faults* strike once, at a time of the fault phase: an orchestrator killed (SIGKILL), stalled
past its lease TTL, its host's clock jumping, a second orchestrator started beside the first. After
``fault_phase_s`` every fault stops, and the study must then end (liveness) within ``settle_s``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from simulation.backends import KINDS, BackendSettings, draws, rate
from simulation.backends.slurm import SlurmSettings, with_node_failures
from simulation.cluster import JobFaults, Program
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
            disk_full_per_write=0.0,
        )

    def describe(self) -> str:
        lines = [
            f"seed {self.seed}: {self.backend.kind}, {self.num_trials} trials, "
            f"{self.num_parallel} in parallel, "
            f"max_restarts {self.max_restarts}, pruner {self.pruner}, timeout {self.timeout_s}, "
            f"hang timeout {self.hang_timeout_s}, orchestrators on {2 if self.two_hosts else 1} host(s), "
            f"{self.num_nodes} node(s) per job",
            f"program: {self.program.steps} steps of {self.program.step_s:.0f}s, "
            f"{'a result file' if self.program.writes_result else 'exit 0 without a result file'}, "
            f"same-step reports {self.program.same_step_reports}",
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
        if self.crash_after_write:
            lines.append(
                f"an orchestrator crashes just after an Optuna write commits with probability "
                f"{self.crash_after_write:.3f}"
            )
        lines += [f"timed: {fault.describe()}" for fault in self.timed]
        return "\n".join(lines)


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
    return _with_node_failures(_with_crashes_after_writes(_with_pbt(_with_asha(scenario))))


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
