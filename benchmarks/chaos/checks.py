"""What must hold after a soak, read from what the study left behind.

- the last ``tunepod run`` exited 0;
- Optuna (the study's journal, read with optuna): exactly ``num_trials`` trials, numbered 0..n-1,
  every one COMPLETE, no two with the same parameters;
- MLflow (asked through the server): exactly one run per trial number, COMPLETE and FINISHED, whose
  metric history is the trial's metrics file point for point (every report mirrored once, nothing
  else), ending at the trial's Optuna value;
- each trial's ``result.json`` holds its Optuna value; its checkpoints are all valid (checksums),
  the newest is the last epoch and loads (``tunepod.runtime``) to the trial's ``x`` and epoch;
- every start of a trial's script (its ``starts.log``) resumed from the newest checkpoint saved before
  it, and reported only the epochs after that checkpoint, each once: no epoch trained twice after the
  checkpoint it resumed from, whatever restarted it (a job fault, a requeue, a lost node);
- a trial restarted only when a job-level fault hit it (an orchestrator kill or an MLflow outage must
  re-attach, never restart; a lost node is a job-level fault), and within ``max_restarts``;
- no process carrying the soak's marker, no Slurm job of the study in the queue.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from benchmarks.chaos.faults import JOB_FAULTS, Injection
from benchmarks.chaos.study import EXPERIMENT, MARKER_ENV, METRIC, ChaosStudy, carrying
from tunepod.hpo.study import make_storage
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_submission
from tunepod.runtime import Report, latest_checkpoint, read_reports, read_result, valid_checkpoints
from tunepod.runtime.checkpoints import load_latest_checkpoint, step_folders


@dataclass(frozen=True)
class Check:
    name: str
    problems: list[str]
    """Empty when the check held."""
    detail: str = ""
    """What was seen when it held."""

    @property
    def held(self) -> bool:
        return not self.problems


@dataclass
class Verdict:
    """Every check, and the problems found per trial (to tell which faults' trials they hit)."""

    checks: list[Check] = field(default_factory=list)
    trial_problems: dict[int, list[str]] = field(default_factory=dict)

    def add(self, name: str, problems: dict[int | None, list[str]], detail: str = "") -> None:
        flat = [f"trial {n}: {p}" if n is not None else p for n, ps in problems.items() for p in ps]
        self.checks.append(Check(name, flat, detail))
        for number, found in problems.items():
            if number is not None and found:
                self.trial_problems.setdefault(number, []).extend(found)

    @property
    def held(self) -> bool:
        return all(check.held for check in self.checks)


def verdict(
    study: ChaosStudy, tracking_uri: str, exit_codes: list[int], injected: list[Injection]
) -> Verdict:
    """Run every check but the leftover one (``leftovers``: after the soak stopped its own servers)."""
    found = Verdict()
    last = exit_codes[-1] if exit_codes else None
    runs = f"exit codes of the {len(exit_codes)} runs: {exit_codes}"
    found.add("last tunepod run exited 0", {None: [] if last == 0 else [runs]}, runs)
    trials = study_trials(study)
    found.add("Optuna: num_trials COMPLETE, once each", optuna_problems(study, trials), _states(trials))
    values = {t.number: t.value for t in trials}
    found.add("MLflow: one run per trial, each report once", mlflow_problems(study, tracking_uri, values))
    found.add("result.json holds the Optuna value", result_problems(study, values))
    found.add("checkpoints valid, last epoch loads", checkpoint_problems(study, trials))
    found.add("each start resumed from the newest checkpoint", resumes(study))
    restarts = restart_problems(study, injected)
    found.add("restarts only after a job fault", restarts, _attempts(study))
    return found


def leftovers(marker: str, study: ChaosStudy) -> Check:
    """No process carrying the soak's marker, no Slurm job whose batch script is under the study."""
    problems = [f"process {pid} still runs: {_cmdline(pid)}" for pid in carrying(MARKER_ENV, marker)]
    problems += [f"Slurm job still queued: {line}" for line in slurm_jobs_under(study.root)]
    return Check("nothing left running (processes, Slurm jobs)", problems)


# ------------------------------------------------------------------------------------------- Optuna


def study_trials(study: ChaosStudy) -> list[FrozenTrial]:
    loaded = optuna.load_study(study_name=study.name, storage=make_storage(f"journal://{study.journal}"))
    return sorted(loaded.get_trials(deepcopy=False), key=lambda t: t.number)


def optuna_problems(study: ChaosStudy, trials: list[FrozenTrial]) -> dict[int | None, list[str]]:
    problems: dict[int | None, list[str]] = {None: []}
    numbers = [t.number for t in trials]
    if numbers != list(range(study.num_trials)):
        problems[None].append(f"trial numbers {numbers}, want 0..{study.num_trials - 1}")
    for trial in trials:
        if trial.state is not TrialState.COMPLETE:
            problems[trial.number] = [f"Optuna state {trial.state.name}"]
    suggested = [tuple(sorted(t.params.items())) for t in trials]
    if len(set(suggested)) != len(suggested):
        problems[None].append(f"repeated suggestions: {suggested}")
    return problems


# ------------------------------------------------------------------------------------------- MLflow


def mlflow_problems(
    study: ChaosStudy, tracking_uri: str, values: dict[int, float | None]
) -> dict[int | None, list[str]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return {None: [f"no MLflow experiment {EXPERIMENT!r} at {tracking_uri}"]}
    found = client.search_runs(
        [experiment.experiment_id], f"tags.`tunepod.study` = '{study.name}'", max_results=5000
    )
    by_trial: dict[int, list[Any]] = {}
    for run in found:
        by_trial.setdefault(int(run.data.tags["tunepod.trial"]), []).append(run)
    problems: dict[int | None, list[str]] = {None: []}
    extra = sorted(set(by_trial) - set(range(study.num_trials)))
    if extra:
        problems[None].append(f"MLflow runs for trials outside the study: {extra}")
    for number in range(study.num_trials):
        runs = by_trial.get(number, [])
        if len(runs) != 1:
            problems[number] = [f"{len(runs)} MLflow runs, want 1"]
            continue
        problems[number] = run_problems(client, runs[0], study.job_dirs().get(number), values.get(number))
    return problems


def run_problems(client: Any, run: Any, job_dir: Path | None, value: float | None) -> list[str]:
    """One trial's run against its metrics file: state, and the history of the metric, point for point."""
    problems = []
    if run.data.tags.get("tunepod.state") != "COMPLETE" or run.info.status != "FINISHED":
        problems.append(f"MLflow run {run.data.tags.get('tunepod.state')} / {run.info.status}")
    if job_dir is None:
        return [*problems, "no job dir"]
    reports = read_reports(JobPaths(job_dir).metrics)
    reported = [(r.step, int(r.time * 1000), r.metrics[METRIC]) for r in reports]
    points = client.get_metric_history(run.info.run_id, METRIC)
    history = sorted((m.step, m.timestamp, m.value) for m in points)
    if history != sorted(reported):
        problems.append(f"MLflow history of {METRIC} {history} is not the reports {reported}")
    elif value is None or abs(history[-1][2] - value) > 1e-9 * max(1.0, abs(value)):
        problems.append(f"last MLflow {METRIC} {history[-1][2]} is not the Optuna value {value}")
    return problems


# ---------------------------------------------------------------------------------------- job dirs


def result_problems(study: ChaosStudy, values: dict[int, float | None]) -> dict[int | None, list[str]]:
    problems: dict[int | None, list[str]] = {}
    for number, job_dir in study.job_dirs().items():
        result = read_result(JobPaths(job_dir).result)
        if result is None:
            problems[number] = ["no result.json"]
        elif values.get(number) is None or result.metrics.get(METRIC) != values[number]:
            problems[number] = [f"result.json {result.metrics} but Optuna value {values.get(number)}"]
    return problems


def checkpoint_problems(study: ChaosStudy, trials: list[FrozenTrial]) -> dict[int | None, list[str]]:
    """Every step folder of every trial valid, and the newest one the last epoch, loading to the
    trial's own ``x`` and Optuna value (a torn or mixed-up checkpoint shows in one of them)."""
    problems: dict[int | None, list[str]] = {}
    params = {t.number: t.params for t in trials}
    values = {t.number: t.value for t in trials}
    for number, job_dir in study.job_dirs().items():
        folder = JobPaths(job_dir).checkpoints
        found = []
        valid = {info.path for info in valid_checkpoints(folder)}
        invalid = [p.name for p in step_folders(folder) if p not in valid]
        if invalid:
            found.append(f"invalid checkpoint folders {invalid}")
        latest = latest_checkpoint(folder)
        if latest is None or latest.step != study.epochs - 1:
            found.append(f"newest valid checkpoint is {latest and latest.step}, want {study.epochs - 1}")
        loaded = load_latest_checkpoint(folder)
        state = loaded.state if loaded is not None else {}
        want = {"epoch": study.epochs - 1, "x": params.get(number, {}).get("x"), "score": values.get(number)}
        if state != want:
            found.append(f"latest checkpoint holds {state}, want {want}")
        problems[number] = found
    return problems


@dataclass(frozen=True)
class Start:
    """One start of a trial's training script: a line of its ``starts.log`` (rank 0 writes it)."""

    time: float
    """``time.time()`` just before it loaded its latest checkpoint."""
    resumed_from: int | None
    """The step of the checkpoint it loaded, -1 when there was none; None on a line without it."""


def read_starts(job_dir: Path) -> list[Start]:
    path = job_dir / "starts.log"
    starts = []
    for line in path.read_text().splitlines() if path.exists() else []:
        fields = line.split()
        if fields:
            starts.append(Start(float(fields[0]), int(fields[1]) if len(fields) > 1 else None))
    return starts


def resumes(study: ChaosStudy) -> dict[int | None, list[str]]:
    """``resume_problems`` of every trial, from its starts, its reports and its checkpoints now."""
    problems: dict[int | None, list[str]] = {}
    for number, job_dir in study.job_dirs().items():
        paths = JobPaths(job_dir)
        saved = [(info.step, info.time) for info in valid_checkpoints(paths.checkpoints)]
        problems[number] = resume_problems(read_starts(job_dir), read_reports(paths.metrics), saved)
    return problems


def resume_problems(
    starts: Sequence[Start], reports: Sequence[Report], saved: Sequence[tuple[int, float]]
) -> list[str]:
    """Each start resumed from the newest checkpoint saved before it and then reported the steps after
    that checkpoint, in order, each once, up to the next start (pure).

    ``saved`` holds the (step, metadata time) of the checkpoints left at the end: the newest few, the
    older ones pruned. When one of them was saved before a start, the newest such is the one it must
    have loaded. Otherwise the newest one before the start is gone or never was, and the reports bound
    it: the script reports an epoch, then saves its checkpoint, so it is the last step reported before
    the start, or the one before that (killed between the report and the save), or none (-1).
    """
    problems = []
    ends = [start.time for start in starts[1:]] + [math.inf]
    for index, (start, end) in enumerate(zip(starts, ends, strict=True), 1):
        resumed = start.resumed_from
        if resumed is None:
            continue
        at = f"start {index} (+{start.time - starts[0].time:.1f} s) resumed from step {resumed}"
        older = [step for step, saved_at in saved if saved_at < start.time]
        last = max((r.step for r in reports if r.time < start.time), default=-1)
        want = {max(older)} if older else {max(last - 1, -1), last}
        if resumed not in want:
            problems.append(f"{at}, the newest saved before it: {' or '.join(map(str, sorted(want)))}")
        trained = [r.step for r in reports if start.time < r.time < end]
        expected = list(range(resumed + 1, resumed + 1 + len(trained)))
        if trained != expected:
            problems.append(f"{at}, then reported steps {trained}, want {expected}")
    return problems


def restart_problems(study: ChaosStudy, injected: Iterable[Injection]) -> dict[int | None, list[str]]:
    hit = {number for i in injected if i.kind in JOB_FAULTS for number in i.trials}
    problems: dict[int | None, list[str]] = {}
    for number, job_dir in study.job_dirs().items():
        record = read_submission(JobPaths(job_dir))
        attempt = record.attempt if record is not None else 0
        if attempt > 1 and number not in hit:
            problems[number] = [f"attempt {attempt}, but no job-level fault hit it"]
        elif attempt > 1 + study.max_restarts:
            problems[number] = [f"attempt {attempt} beyond max_restarts {study.max_restarts}"]
    stale = sorted(p.name for p in study.jobs_dir.glob("trial-*.stale-*"))
    problems[None] = [f"job dirs set aside as stale: {stale}"] if stale else []
    return problems


def trial_effects(study: ChaosStudy) -> dict[int, str]:
    """What happened to each trial's job: its attempt, how often its script started, and the first
    step each later start reported (a start that resumed from a checkpoint reports past step 0)."""
    effects = {}
    for number, job_dir in study.job_dirs().items():
        record = read_submission(JobPaths(job_dir))
        starts = read_starts(job_dir)
        reports = read_reports(JobPaths(job_dir).metrics)
        attempt = record.attempt if record is not None else "?"
        effects[number] = f"attempt {attempt}, {len(starts)} starts" + "".join(
            _resumed(start, reports, study.epochs) for start in starts[1:]
        )
    return effects


def _resumed(start: Start, reports: Sequence[Report], epochs: int) -> str:
    step = next((r.step for r in reports if r.time > start.time), None)
    if step is not None:
        return f", resumed at step {step}"
    if start.resumed_from == epochs - 1:
        return ", resumed after its last checkpoint (nothing left to train)"
    return ", no report after it"


# ----------------------------------------------------------------------------------------- helpers


def slurm_jobs_under(root: Path) -> list[str]:
    """``<id> <state> <script>`` of the Slurm jobs in the queue whose batch script is under ``root``."""
    try:
        listed = subprocess.run(
            ["squeue", "-h", "-o", "%i %T %o"], capture_output=True, text=True, timeout=30, check=False
        )
    except FileNotFoundError:  # no Slurm here: nothing of ours can be queued
        return []
    return [line for line in listed.stdout.splitlines() if str(root) in line]


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    return "?"


def _states(trials: list[FrozenTrial]) -> str:
    counts: dict[str, int] = {}
    for trial in trials:
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))


def _attempts(study: ChaosStudy) -> str:
    attempts = {}
    for number, job_dir in study.job_dirs().items():
        record = read_submission(JobPaths(job_dir))
        attempts[number] = record.attempt if record is not None else 0
    restarted = {n: a for n, a in attempts.items() if a > 1}
    return f"restarted trials (attempt): {restarted or 'none'}"
