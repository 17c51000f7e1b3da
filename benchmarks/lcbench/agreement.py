"""LCBench through `tunepod run`, beside the same study in simulated time: do the two agree?

    .venv/bin/python -m benchmarks.lcbench.agreement                              # 3945 and 7593
    .venv/bin/python -m benchmarks.lcbench.agreement --instances 34539 --trials 8 --epochs 12

The LCBench table's tunepod arms run the real Tuner and search policy in simulated time on the
surrogate's curves (``tunepod_arms``). This runs the same study as a user runs it: the arm's tune
step, with ``examples/lcbench/train.py`` as its training job, through `tunepod run` on the local
launcher, where each trial is a process that sleeps ``time_scale`` of each epoch's surrogate time
and reports the surrogate's value. Then it compares the study `tunepod run` left with the simulated
one, trial by trial: the parameters asked, how each trial ended (COMPLETE, PRUNED, ...), its value
at every epoch both trained, and the epochs each trained.

One trial at a time: the sampler's asks and the policy's decisions then depend only on the values
told, in one order, so the two must agree exactly, save for one thing real time adds. A stop that
reaches a job after its next epoch ended (the tuner polls every ``poll_s``, the stop takes its
time) lets the job train that epoch too. Such *late epochs* are counted and shown, and change no
decision: a rung is judged on its own epoch's value (forecasts on the curve up to it), a promoted
trial resumes from its newest checkpoint, and the sampler learns from finished trials only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from benchmarks.lcbench.problem import Problem, make_problem
from benchmarks.lcbench.surrogate import DATA_DIR
from benchmarks.lcbench.tunepod_arms import POLICIES, LcbenchCurve, tune_step
from benchmarks.simulated_tuner import QualityTrace, outcome_of, run_quality_study
from tunepod.hpo.study import make_storage
from tunepod.launch.paths import JobPaths
from tunepod.runtime import read_reports
from tunepod.spec.models import TuneSettings

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "lcbench" / "train.py"
STEP = "search"


@dataclass(frozen=True)
class Study:
    """What the two runs are to agree on: one arm's study of one instance, one trial at a time."""

    instance: str
    arm: str = "tunepod-asha-forecast"
    trials: int = 8
    epochs: int = 12
    seed: int = 0
    time_scale: float = 0.1
    """Share of the surrogate's epoch time each real epoch sleeps."""

    def problem(self) -> Problem:
        return dataclasses.replace(make_problem(self.instance), max_epochs=self.epochs)

    def tune_step(self, train: dict[str, Any] | None = None) -> dict[str, Any]:
        problem = self.problem()
        sampler, pruner = POLICIES[self.arm](problem)
        step = tune_step(problem, 1, self.seed, sampler, pruner, train)
        return step | {"num_trials": self.trials}


@dataclass(frozen=True)
class TrialSeen:
    """One trial as a run left it: the parameters asked, its outcome, each epoch's value."""

    number: int
    params: Mapping[str, Any]
    outcome: str
    values: Mapping[int, float]
    """Step (epoch - 1) -> val_accuracy, for every epoch the trial trained."""


@dataclass(frozen=True)
class Agreement:
    study: Study
    real: list[TrialSeen]
    simulated: list[TrialSeen]
    real_s: float
    """Wall seconds of `tunepod run`."""
    simulated_s: float
    """Simulated seconds of the study at full epoch times (the real run sleeps ``time_scale`` of them)."""

    @property
    def differences(self) -> list[str]:
        """Every way the real run differs from the simulated one, late epochs aside."""
        return differences(self.real, self.simulated)

    @property
    def late_epochs(self) -> int:
        """Epochs the real run trained that the simulated one did not (stops that landed late)."""
        simulated = {trial.number: trial for trial in self.simulated}
        return sum(
            len(set(trial.values) - set(simulated[trial.number].values))
            for trial in self.real
            if trial.number in simulated
        )


def differences(real: Sequence[TrialSeen], simulated: Sequence[TrialSeen]) -> list[str]:
    found = []
    if [t.number for t in real] != [t.number for t in simulated]:
        found.append(
            f"trials {[t.number for t in real]} ran for real, {[t.number for t in simulated]} simulated"
        )
    for mine, theirs in zip(real, simulated, strict=False):
        name = f"trial {mine.number}"
        if dict(mine.params) != dict(theirs.params):
            found.append(f"{name} was asked {dict(mine.params)} for real, {dict(theirs.params)} simulated")
        if mine.outcome != theirs.outcome:
            found.append(f"{name} ended {mine.outcome} for real, {theirs.outcome} simulated")
        if missing := sorted(set(theirs.values) - set(mine.values)):
            found.append(f"{name} never trained epochs {[s + 1 for s in missing]} for real")
        for step in sorted(set(mine.values) & set(theirs.values)):
            if mine.values[step] != theirs.values[step]:
                found.append(
                    f"{name} epoch {step + 1}: {mine.values[step]} for real, {theirs.values[step]} simulated"
                )
    return found


def run_real(
    study: Study, workdir: Path, env: Mapping[str, str] | None = None
) -> tuple[list[TrialSeen], float]:
    """``study`` through `tunepod run` in ``workdir`` (its stores and jobs), with ``env`` added to
    this process's environment (a Prefect server's ``PREFECT_API_URL``); its trials and wall seconds."""
    train = {
        "entrypoint": str(TRAIN_SCRIPT),
        "args": {"instance": study.instance, "epochs": study.epochs, "time_scale": study.time_scale},
    }
    tune = study.tune_step(train)
    tune["study"]["storage"] = f"journal://{workdir}/optuna.log"
    spec = {
        "name": f"lcbench-agreement-{study.instance}",
        "tracking": {"uri": f"sqlite:///{workdir}/mlflow.db", "experiment": "lcbench-agreement"},
        "launcher": {"kind": "local", "root": str(workdir / "shared")},
        "steps": {
            "data": {"uses": "stage", "with": {"source": str(DATA_DIR), "target": "fsx:///datasets/lcbench"}},
            STEP: {"uses": "tune", "needs": ["data"], "with": tune},
        },
    }
    spec_file = workdir / "pipeline.yaml"
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    log = workdir / "tunepod-run.log"
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "tunepod.cli", "run", str(spec_file)],
            cwd=workdir,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        )
    wall_s = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"tunepod run {spec_file} exited {done.returncode}:\n{log.read_text()[-4000:]}")
    settings = TuneSettings.model_validate(tune)
    storage = make_storage(tune["study"]["storage"])
    trials = storage.get_all_trials(storage.get_study_id_from_name(settings.study.name))
    return [_seen_for_real(trial, workdir / "shared") for trial in trials], wall_s


def _seen_for_real(trial: Any, root: Path) -> TrialSeen:
    (job_dir,) = root.glob(f"**/trial-{trial.number}")
    values = {
        report.step: report.metrics["val_accuracy"] for report in read_reports(JobPaths(job_dir).metrics)
    }
    return TrialSeen(trial.number, dict(trial.params), outcome_of(trial), values)


def run_simulated(study: Study, startup_s: float = 5.0) -> tuple[list[TrialSeen], float]:
    """``study`` by the real Tuner in simulated time; its trials and simulated seconds."""
    trace = run_quality_study(
        TuneSettings.model_validate(study.tune_step()),
        LcbenchCurve(study.problem(), startup_s),
        seed=study.seed,
        num_parallel=1,
    )
    return _seen_simulated(trace), trace.simulated_s


def _seen_simulated(trace: QualityTrace) -> list[TrialSeen]:
    values: dict[int, dict[int, float]] = {number: {} for number in trace.outcomes}
    for report in trace.reports:
        values[report.trial][report.step] = report.value
    return [
        TrialSeen(number, trace.params[number], trace.outcomes[number], values[number])
        for number in sorted(trace.outcomes)
    ]


def agree(study: Study, workdir: Path, env: Mapping[str, str] | None = None) -> Agreement:
    real, real_s = run_real(study, workdir, env)
    simulated, simulated_s = run_simulated(study)
    return Agreement(study, real, simulated, real_s, simulated_s)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lcbench.agreement", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--instances", default="3945,7593", help="comma-separated LCBench instances (3945,7593)"
    )
    parser.add_argument(
        "--arm", default="tunepod-asha-forecast", choices=sorted(POLICIES), help="the arm's policy"
    )
    parser.add_argument("--trials", type=int, default=8, help="trials per study (8)")
    parser.add_argument("--epochs", type=int, default=12, help="epochs per trial, at most 52 (12)")
    parser.add_argument("--seed", type=int, default=0, help="the study's seed (0)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=0.1,
        help="share of each epoch's surrogate time a real epoch sleeps",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    console = Console(width=max(Console().width, 160))
    table = Table(title="LCBench: `tunepod run` against the same study in simulated time")
    for column in (
        "instance",
        "arm",
        "trials",
        "outcomes",
        "epochs real / simulated",
        "late epochs",
        "best real / simulated",
        "wall s real",
        "simulated s x scale",
        "agree",
    ):
        table.add_column(column)
    disagreed = False
    for instance in args.instances.split(","):
        study = Study(instance, args.arm, args.trials, args.epochs, args.seed, args.time_scale)
        with tempfile.TemporaryDirectory(prefix=f"lcbench-agreement-{instance}-") as workdir:
            result = agree(study, Path(workdir))
        for difference in result.differences:
            console.print(f"[red]{instance}: {difference}[/red]")
        disagreed |= bool(result.differences)
        table.add_row(*_row(result))
    console.print(table)
    return 1 if disagreed else 0


def _row(result: Agreement) -> list[str]:
    def epochs(trials: list[TrialSeen]) -> int:
        return sum(len(t.values) for t in trials)

    def best(trials: list[TrialSeen]) -> str:
        return f"{max((v for t in trials for v in t.values.values()), default=float('nan')):.3f}"

    outcomes = sorted({t.outcome for t in result.real})
    counts = ", ".join(f"{sum(t.outcome == o for t in result.real)} {o}" for o in outcomes)
    study = result.study
    return [
        study.instance,
        study.arm,
        str(len(result.real)),
        counts,
        f"{epochs(result.real)} / {epochs(result.simulated)}",
        str(result.late_epochs),
        f"{best(result.real)} / {best(result.simulated)}",
        f"{result.real_s:.0f}",
        f"{result.simulated_s * study.time_scale:.0f}",
        "yes" if not result.differences else "NO",
    ]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
