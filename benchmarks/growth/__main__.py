"""``python -m benchmarks.growth``: does the orchestrator's work per report grow with the trial?

One trial whose job reports ``--reports`` steps (100,000; ``--long``: 1,000,000) paced at ``--rate``
reports per second (1,000; ``--long``: 1,500), in bursts, through the training contract, and saves a
``--state-mb`` checkpoint at every tenth, driven by the real orchestrator (``tunepod run`` on a
generated spec: stage a one-file folder, tune ``trainer.py`` with a pruner; MLflow on SQLite and Optuna
on a journal file, both in the work folder). The study already holds one completed trial that reported
every step (at 0.0, below the measured trial's 1.0), so the pruner compares at every step it is asked
about and never prunes.

While it runs, the orchestrator process's CPU time (``/proc/<pid>/stat``: user + system, its own
threads only) is sampled every ``--sample-s`` against the reports it has consumed: the least of what
the job wrote, what the orchestrator mirrored into MLflow and what it told Optuna (see ``measure``).
The run is cut where that count crossed each tenth of the reports; the first tenth is the baseline,
the last one tunepod's figure. Goal: CPU per report flat, the last tenth at most 1.2x the first. The
trial's end (from its last report consumed to its MLflow record written) is shown apart.

The work folder is on tmpfs (``/dev/shm``) when there is one, so that the job's fsync per report
costs no disk wait and 100,000 reports fit in 100 s; ``--dir`` puts it elsewhere. Exit 0, or 1 when a
side failed (the orchestrator exited non-zero, the job never wrote all its reports, the orchestrator
never consumed them); a missed goal is reported, not an error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
import yaml
from rich.console import Console
from rich.table import Table

from benchmarks.growth.measure import (
    LineCounter,
    OptunaProgress,
    Sample,
    Tenth,
    process_cpu_s,
    tenths,
    trial_end,
)
from tunepod.hpo.study import make_storage
from tunepod.tracking.mirror import MirrorState, read_mirror_state

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).with_name("trainer.py")
STUDY = "growth"
METRIC = "score"
PARAM = "variant"
#: Trial 0 is the completed one the benchmark records before the run; the orchestrator runs trial 1.
MEASURED_TRIAL = 1
GOAL = 1.2
SHORT = {"reports": 100_000, "rate": 1000.0}
LONG = {"reports": 1_000_000, "rate": 1500.0}

console = Console(highlight=False, soft_wrap=True)


class SideFailed(Exception):
    """The orchestrator or the job did not finish the run: no figure to show."""


@dataclass(frozen=True)
class Run:
    samples: list[Sample]
    end: Sample
    """When the trial ended in the orchestrator (its MLflow record written)."""
    exit_code: int
    log: Path


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.growth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--long", action="store_true", help=f"the long form: {LONG} (default: {SHORT})")
    parser.add_argument("--reports", type=int, help="steps the job reports")
    parser.add_argument("--rate", type=float, help="reports per second the job paces itself to")
    parser.add_argument("--state-mb", type=float, default=1.0, help="checkpoint saved at every tenth (MB)")
    parser.add_argument("--pruner", choices=["median", "hyperband", "none"], default="median")
    parser.add_argument("--storage", choices=["journal", "sqlite"], default="journal", help="Optuna's")
    parser.add_argument("--poll-s", type=float, default=0.5, help="the tune step's poll_s")
    parser.add_argument("--orchestrator", choices=["cli", "library"], default="cli",
                        help="cli: tunepod run; library: PipelineRun's steps, no Prefect")  # fmt: skip
    parser.add_argument("--prefect-api", help="a running Prefect server (default: the temporary one)")
    parser.add_argument("--sample-s", type=float, default=0.2, help="seconds between CPU samples")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="bound on the whole run")
    parser.add_argument("--dir", type=Path, help="where the work folder goes (default: /dev/shm, or temp)")
    parser.add_argument("--json", type=Path, help="also write every figure there")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, job dir, stores)")
    args = parser.parse_args(argv)
    form = LONG if args.long else SHORT
    args.reports = args.reports or int(form["reports"])
    args.rate = args.rate or form["rate"]
    if args.reports < 100:
        parser.error("--reports must be at least 100 (ten tenths of ten)")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    base = args.dir or (Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None)
    folder = Path(tempfile.mkdtemp(prefix="bench-growth-", dir=base))
    load = os.getloadavg()[0]
    console.print(f"growth benchmark on {machine()}, 1-minute load {load:.2f}, work folder {folder}")
    console.print(
        f"{args.reports:,} reports at {args.rate:,.0f}/s, pruner {args.pruner}, Optuna {args.storage}, "
        f"poll_s {args.poll_s}, orchestrator {args.orchestrator}, git {git_head()}"
    )
    figures: dict[str, Any] = {"machine": machine(), "load_before": load, "args": vars_of(args)}
    failed = ""
    try:
        spec = prepare(folder, args)
        run = orchestrate(folder, spec, args)
        figures["samples"] = [asdict(s) for s in run.samples]
        figures |= report(run, args)
    except SideFailed as exc:
        failed = str(exc)
        console.print(f"[red]side failed: {failed}")
    figures["failed"] = failed
    figures["load_after"] = os.getloadavg()[0]
    console.print(f"1-minute load after: {figures['load_after']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    if failed or args.keep:
        console.print(f"work folder kept: {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------- the run


def prepare(folder: Path, args: argparse.Namespace) -> Path:
    """The data folder, the spec, and the study with its completed trial; returns the spec's path."""
    (folder / "data").mkdir()
    (folder / "data" / "README").write_text("the growth benchmark stages this folder\n")
    storage = storage_uri(folder, args)
    study = optuna.create_study(storage=make_storage(storage), study_name=STUDY, direction="maximize")
    study.add_trial(
        optuna.trial.create_trial(
            params={PARAM: 0},
            distributions={PARAM: optuna.distributions.CategoricalDistribution([0])},
            value=0.0,
            intermediate_values=dict.fromkeys(range(args.reports), 0.0),
        )
    )
    trainer_args = {"reports": args.reports, "rate": args.rate, "state_mb": args.state_mb}
    spec = {
        "name": "growth",
        "tracking": {"uri": f"sqlite:///{folder}/mlflow.db", "experiment": "growth"},
        "launcher": {"kind": "local", "root": str(folder / "shared")},
        "steps": {
            "data": {"uses": "stage", "with": {"source": str(folder / "data"), "target": "fsx:///data"}},
            "search": {
                "uses": "tune",
                "needs": ["data"],
                "with": {
                    "train": {"entrypoint": str(TRAINER), "args": trainer_args},
                    "study": {"name": STUDY, "storage": storage, "direction": "maximize", "metric": METRIC},
                    "num_trials": 2,
                    "num_parallel": 1,
                    "sampler": "random",
                    "seed": 0,
                    "poll_s": args.poll_s,
                    "pruner": {"kind": args.pruner},
                    "space": {PARAM: {"type": "categorical", "choices": [0]}},
                },
            },
        },
    }
    path = folder / "growth.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def storage_uri(folder: Path, args: argparse.Namespace) -> str:
    return f"journal://{folder}/optuna.log" if args.storage == "journal" else f"sqlite:///{folder}/optuna.db"


def orchestrate(folder: Path, spec: Path, args: argparse.Namespace) -> Run:
    """Run the orchestrator on ``spec``, sampling its CPU against the job's reports until the trial
    ended (its MLflow record written), then wait for it to exit."""
    log = folder / "orchestrator.log"
    if args.orchestrator == "cli":
        argv = [*tunepod_command(), "run", str(spec)]
    else:
        argv = [sys.executable, "-m", "benchmarks.growth.orchestrate", str(spec)]
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_COLORS": "false"}
    env.pop("PREFECT_API_URL", None)
    if args.prefect_api:
        env["PREFECT_API_URL"] = args.prefect_api
    else:  # the temporary server, in a home of the benchmark's own
        env["PREFECT_HOME"] = str(folder / "prefect")
        env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    launched = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        samples, end = sample(process, folder, launched, args)
        code = process.wait(timeout=max(60.0, args.timeout_s - (time.monotonic() - launched)))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if code != 0:
        raise SideFailed(f"the orchestrator exited {code}; its log, {log}:\n{tail(log)}")
    if end is None:
        raise SideFailed(f"the trial's MLflow record was never written; log {log}:\n{tail(log)}")
    return Run(samples, end, code, log)


def sample(
    process: subprocess.Popen[bytes], folder: Path, launched: float, args: argparse.Namespace
) -> tuple[list[Sample], Sample | None]:
    """Samples every ``--sample-s`` until the trial's record is final (returned as the end) or the
    orchestrator exits (None)."""
    jobs = folder / "shared" / "jobs" / STUDY
    storage = storage_uri(folder, args)
    samples: list[Sample] = []
    counter: LineCounter | None = None
    optuna_progress = OptunaProgress(storage, MEASURED_TRIAL)
    while time.monotonic() - launched < args.timeout_s:
        cpu = process_cpu_s(process.pid)
        if cpu is None or process.poll() is not None:
            return samples, None
        job_dir = counter.path.parent if counter else next(jobs.glob(f"trial-{MEASURED_TRIAL}"), None)
        if counter is None and job_dir is not None:
            counter = LineCounter(job_dir / "metrics.jsonl")
        written = counter.count() if counter else 0
        mirrored = read_mirror_state(job_dir) if job_dir is not None else MirrorState()
        told = optuna_progress.read()
        consumed = min(written, mirrored.synced_step + 1, told + 1)
        taken = Sample(time.monotonic() - launched, cpu, consumed, written, mirrored.synced_step, told)
        samples.append(taken)
        if mirrored.finalized:
            return samples, taken
        time.sleep(args.sample_s)
    raise SideFailed(f"the run took longer than --timeout-s {args.timeout_s:.0f}")


# ---------------------------------------------------------------------------------------------- report


def report(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """The tenths table, the summary table and the goal line; returns the figures."""
    total = args.reports
    if run.end.written < total:
        raise SideFailed(f"the job wrote {run.end.written:,} of {total:,} reports; log {run.log}")
    try:
        cut = tenths(run.samples, total)
        end_cpu_s, end_wall_s = trial_end(run.samples, total, run.end)
    except ValueError as exc:
        raise SideFailed(f"{exc}; log {run.log}") from exc
    first, last = cut[0], cut[-1]
    table = Table(title=f"Orchestrator CPU per 1,000 reports, one trial of {total:,} reports, by tenth")
    for column in ("tenth", "reports", "wall s", "CPU s", "CPU ms / 1,000 reports", "vs first tenth"):
        table.add_column(column, justify="right")
    for tenth in cut:
        table.add_row(
            str(tenth.index), f"{tenth.reports:,}", f"{tenth.wall_s:.1f}", f"{tenth.cpu_s:.2f}",
            f"{tenth.cpu_ms_per_1000:.0f}", shown(against(tenth, first)),
        )  # fmt: skip
    console.print(table)
    ratio = against(last, first)
    summary = Table(title="Growth: the last tenth against the first")
    summary.add_column("side")
    summary.add_column("what")
    summary.add_column("CPU ms / 1,000 reports", justify="right")
    summary.add_row("baseline", "first tenth of the run", f"{first.cpu_ms_per_1000:.0f}")
    summary.add_row("tunepod", "last tenth of the run", f"{last.cpu_ms_per_1000:.0f}")
    summary.add_row("ratio", "tunepod / baseline", shown(ratio))
    console.print(summary)
    first_at = next(s.at_s for s in run.samples if s.written > 0)
    last_at = next(s.at_s for s in run.samples if s.written >= total)
    console.print(
        f"the job wrote its reports from {first_at:.0f} s to {last_at:.0f} s after launch "
        f"({total / max(last_at - first_at, 1e-9):,.0f} reports/s); the orchestrator consumed the last one "
        f"{run.end.at_s - end_wall_s - last_at:.1f} s after it was written. The trial's end after that "
        f"(its outcome told Optuna, its MLflow record and model written) took {end_cpu_s:.2f} s CPU, "
        f"{end_wall_s:.1f} s wall. CPU: the orchestrator process's own threads; {len(run.samples)} samples."
    )
    met = ratio is not None and ratio <= GOAL
    verdict = "[green]met" if met else "[red]NOT met" if ratio is not None else "[yellow]not measurable"
    console.print(f"goal: CPU per report flat, last tenth <= {GOAL}x the first: {shown(ratio)}x: {verdict}")
    return {
        "tenths": [asdict(t) | {"cpu_ms_per_1000": t.cpu_ms_per_1000} for t in cut],
        "ratio": ratio,
        "goal_met": met,
        "trial_end_cpu_s": end_cpu_s,
        "trial_end_wall_s": end_wall_s,
        "lag_s": run.end.at_s - end_wall_s - last_at,
        "reports_written": run.end.written,
        "reports_consumed": run.end.reports,
    }


def against(tenth: Tenth, first: Tenth) -> float | None:
    """``tenth``'s CPU per report over the first tenth's; None when the first took no CPU tick (a run
    of a few hundred reports per tenth: /proc counts CPU in ticks of 10 ms)."""
    return tenth.cpu_s / first.cpu_s if first.cpu_s > 0 else None


def shown(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def tunepod_command() -> list[str]:
    entry_point = Path(sys.executable).with_name("tunepod")
    return [str(entry_point)] if entry_point.exists() else [sys.executable, "-m", "tunepod.cli"]


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def machine() -> str:
    return f"{platform.node()} ({os.cpu_count()} CPUs, {platform.python_version()})"


def git_head() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return found.stdout.strip() or "?"


def vars_of(args: argparse.Namespace) -> dict[str, Any]:
    return {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}


if __name__ == "__main__":
    started = datetime.now()
    code = main(sys.argv[1:])
    console.print(f"finished in {(datetime.now() - started).total_seconds():.0f} s")
    sys.exit(code)
