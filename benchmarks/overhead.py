"""Orchestration overhead of ``tunepod run`` against bare torchrun, on the same six digits trials.

    .venv/bin/python benchmarks/overhead.py                    # make bench-overhead
    .venv/bin/python benchmarks/overhead.py --repeats 3 --epochs 4
    .venv/bin/python benchmarks/overhead.py --prefect-api http://127.0.0.1:4200/api
    .venv/bin/python benchmarks/overhead.py --prefect-api URL --mlflow-uri URL   # servers already running
    .venv/bin/python benchmarks/overhead.py --stack .tunepod   # the local stack (`tunepod up`), its runner
    .venv/bin/python benchmarks/overhead.py --max-ratio 1.6    # exit 1 when tunepod is slower than that

Both sides run the jobs ``benchmarks/specs/overhead.yaml`` declares: ``num_trials`` trials of
``examples/digits/train.py`` with every parameter fixed, ``num_parallel`` at a time, each one
``torchrun --standalone --nproc-per-node <procs_per_node>``.

* baseline: a plain Python script (this file, run again with a hidden flag) stages the digits with
  ``write_digits`` and keeps ``num_parallel`` torchrun commands running in a poll loop, the
  training-contract variables set by hand. Nothing tracks, tunes or orchestrates.
* tunepod: ``tunepod run`` on the spec, every store redirected into a temp folder with ``--set``.
  Prefect itself keeps its default home (``~/.prefect``), as for any ``tunepod run``.

Each side is timed from its launch to its exit (end to end) and, separately, from its first job's
start to its last job's end (the trial window), so the fixed start-up cost (imports, Prefect's
temporary server, MLflow store creation) shows apart from the cost paid per trial. For tunepod the
job times come from the files the local launcher writes in each job dir: ``submission.json``'s mtime
(its ``submitted_at`` field has whole seconds only) and ``exit_code``'s mtime. With ``--repeats`` the
two sides alternate and the medians are reported. Exit 0, or 1 when a side failed or the end-to-end
ratio exceeds ``--max-ratio``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tunepod import runtime  # standard library only: as light as the baseline script can be

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "benchmarks" / "specs" / "overhead.yaml"
# The baseline loop checks its jobs this often; it bounds how late the loop sees a job end.
BASELINE_POLL_S = 0.05
LOG_TAIL_LINES = 30
# A 1-minute load average above this before the start means other work shares the CPUs with the jobs.
BUSY_LOAD = 1.0
CPU_TIME = "CPU time"
END_TO_END = "end to end"
TRIAL_WINDOW = "trial window"
LEGEND = (
    "end to end: launch to exit of the whole command. trial window: first job start to last job end. "
    "mean job: one job's start to its exit. mean slot gap: a job's end to the start of the job that "
    "takes its slot. CPU time: user + system seconds of the command and all its processes, jobs included "
    "(less sensitive than wall time to other work on the machine)."
)

console = Console(highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """What both sides run, read from the spec so that the two cannot drift apart."""

    stage_step: str
    tune_step: str
    study: str
    entrypoint: str
    params: dict[str, object]
    num_trials: int
    num_parallel: int
    procs_per_node: int


def read_workload(epochs: int) -> Workload:
    """The spec's jobs with ``epochs``; raises ``ValueError`` when a tuned parameter is not fixed."""
    from tunepod.spec.loader import load_spec
    from tunepod.spec.models import CategoricalParam, StageStep, TuneStep

    spec = load_spec(SPEC)
    stage = next(name for name, step in spec.steps.items() if isinstance(step, StageStep))
    tune_name, tune = next((n, s) for n, s in spec.steps.items() if isinstance(s, TuneStep))
    params: dict[str, object] = {**tune.with_.train.args, "epochs": epochs}
    for name, param in tune.with_.space.items():
        if not (isinstance(param, CategoricalParam) and len(param.choices) == 1):
            raise ValueError(f"{SPEC}: space.{name} must be a categorical with one choice (a fixed param)")
        params[name] = param.choices[0]
    return Workload(
        stage_step=stage,
        tune_step=tune_name,
        study=tune.with_.study.name,
        entrypoint=tune.with_.train.entrypoint,
        params=params,
        num_trials=tune.with_.num_trials,
        num_parallel=tune.with_.num_parallel,
        procs_per_node=tune.with_.train.resources.procs_per_node,
    )


# ---------------------------------------------------------------------------------------------- timings


@dataclass(frozen=True)
class Servers:
    """What ``tunepod run`` talks to: nothing (a temporary Prefect server, MLflow on SQLite), running
    servers (``--prefect-api``, ``--mlflow-uri``), or the local stack (``--stack``)."""

    prefect_api: str | None = None
    mlflow_uri: str | None = None
    stack_home: Path | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> Servers:
        if args.stack is None:
            return cls(args.prefect_api, args.mlflow_uri)
        from tunepod.stack.processes import ServiceRecord  # the stack's own record of its MLflow server

        mlflow = ServiceRecord.read(args.stack.resolve() / "stack" / "mlflow-server.json")
        if mlflow is None:
            raise SystemExit(f"--stack {args.stack}: no stack; start it: tunepod up --home {args.stack}")
        return cls(None, args.mlflow_uri or mlflow.url, args.stack.resolve())


@dataclass(frozen=True)
class JobSpan:
    """One trial's job, in seconds since the epoch."""

    trial: int
    start: float
    end: float
    exit_code: int | None
    has_result: bool
    """The job's rank 0 wrote its result file: the training itself ran to the end."""


@dataclass
class SideRun:
    """One timed run of one side."""

    side: str
    launched: float
    exited: float
    jobs: list[JobSpan]
    cpu_s: float
    """User + system CPU seconds of the command and every process under it (jobs included)."""
    warnings: list[str]
    events: dict[str, float] = field(default_factory=dict)
    """Named moments read from the side's log (tunepod: Prefect's log lines)."""
    log: Path | None = None

    @property
    def wall_s(self) -> float:
        return self.exited - self.launched

    @property
    def window_s(self) -> float:
        return max(j.end for j in self.jobs) - min(j.start for j in self.jobs)

    def metrics(self, num_parallel: int) -> dict[str, float]:
        first = min(j.start for j in self.jobs)
        last = max(j.end for j in self.jobs)
        return {
            END_TO_END: self.wall_s,
            "launch -> first job": first - self.launched,
            TRIAL_WINDOW: self.window_s,
            "last job -> exit": self.exited - last,
            "mean job": statistics.fmean(j.end - j.start for j in self.jobs),
            "mean slot gap": mean_slot_gap(self.jobs, num_parallel),
            CPU_TIME: self.cpu_s,
        }


def mean_slot_gap(jobs: Sequence[JobSpan], num_parallel: int) -> float:
    """How long a freed slot stays empty: the k-th job started after the first ``num_parallel``
    takes the slot of the k-th job to end."""
    starts = sorted(j.start for j in jobs)[num_parallel:]
    ends = sorted(j.end for j in jobs)
    gaps = [start - end for start, end in zip(starts, ends, strict=False)]
    return statistics.fmean(gaps) if gaps else 0.0


def children_cpu_s() -> float:
    """CPU seconds of this process's finished descendants: the kernel adds a process's time to its
    parent's children total when the parent reaps it, so a whole reaped tree counts."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class SideFailed(Exception):
    """A side did not run all its jobs to the end; the message says where its logs are."""


def check_jobs(side: str, jobs: Sequence[JobSpan], workload: Workload, logs: Path) -> list[str]:
    """Raise ``SideFailed`` unless every trial trained to the end; return warnings about jobs that
    wrote their result and then exited non-zero (a crash in teardown: the timing still holds)."""
    unfinished = sorted(j.trial for j in jobs if not j.has_result)
    if len(jobs) != workload.num_trials or unfinished:
        raise SideFailed(
            f"{side} ran {len(jobs)} jobs (want {workload.num_trials}); without a result: {unfinished}; "
            f"logs under {logs}"
        )
    return [
        f"{side} trial {j.trial} wrote its result, then exited {j.exit_code} (see {logs})"
        for j in sorted(jobs, key=lambda j: j.trial)
        if j.exit_code != 0
    ]


# ---------------------------------------------------------------------------------------------- baseline


def run_baseline(workload: Workload, work_dir: Path) -> SideRun:
    """Run the baseline script as a child process and time it like a command a user types."""
    log = work_dir / "baseline.log"
    argv = [sys.executable, str(Path(__file__).resolve()), "--baseline-child", str(work_dir)]
    argv += ["--workload", json.dumps(asdict(workload))]
    cpu_before = children_cpu_s()
    launched = time.time()
    with open(log, "wb") as out:
        code = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    exited = time.time()
    cpu_s = children_cpu_s() - cpu_before
    if code != 0:
        raise SideFailed(f"baseline exited {code}; log {log}:\n{tail(log)}")
    spans = json.loads((work_dir / "baseline-jobs.json").read_text())
    jobs = [JobSpan(**span) for span in spans]
    warnings = check_jobs("baseline", jobs, workload, work_dir / "jobs")
    return SideRun("baseline", launched, exited, jobs, cpu_s, warnings, log=log)


def baseline_child(work_dir: Path, workload: Workload) -> None:
    """The baseline itself: stage the data, then keep ``num_parallel`` torchrun jobs going."""
    from tunepod.staging.builtin import write_digits  # numpy and scikit-learn, for the child only

    data_dir = work_dir / "data"
    write_digits(data_dir)
    pending = list(range(workload.num_trials))
    running: dict[int, tuple[subprocess.Popen[bytes], float]] = {}
    spans: list[JobSpan] = []
    while pending or running:
        while pending and len(running) < workload.num_parallel:
            trial = pending.pop(0)
            running[trial] = (start_baseline_job(trial, work_dir, data_dir, workload), time.time())
        time.sleep(BASELINE_POLL_S)
        for trial, (process, started) in list(running.items()):
            if process.poll() is not None:
                has_result = (work_dir / "jobs" / f"trial-{trial}" / "result.json").exists()
                spans.append(JobSpan(trial, started, time.time(), process.returncode, has_result))
                del running[trial]
    (work_dir / "baseline-jobs.json").write_text(json.dumps([asdict(s) for s in spans]))


def start_baseline_job(
    trial: int, work_dir: Path, data_dir: Path, workload: Workload
) -> subprocess.Popen[bytes]:
    """One trial as a bare torchrun command, the training contract's variables set by hand."""
    job_dir = work_dir / "jobs" / f"trial-{trial}"
    job_dir.mkdir(parents=True)
    env = {
        **os.environ,
        runtime.PARAMS_ENV: json.dumps(workload.params, sort_keys=True),
        runtime.DATA_DIR_ENV: str(data_dir),
        runtime.CHECKPOINT_DIR_ENV: str(job_dir / "checkpoints"),
        runtime.RESULT_FILE_ENV: str(job_dir / "result.json"),
        runtime.METRICS_FILE_ENV: str(job_dir / "metrics.jsonl"),
    }
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += ["--nproc-per-node", str(workload.procs_per_node), workload.entrypoint]
    with open(job_dir / "stdout.log", "wb") as stdout, open(job_dir / "stderr.log", "wb") as stderr:
        return subprocess.Popen(
            argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr
        )


# ---------------------------------------------------------------------------------------------- tunepod


def run_tunepod(workload: Workload, work_dir: Path, epochs: int, servers: Servers) -> SideRun:
    """``tunepod run`` on the spec with every store in ``work_dir`` (MLflow: the server of ``servers``
    if any), timed from launch to exit."""
    log = work_dir / "tunepod.log"
    overrides = {
        "tracking.uri": servers.mlflow_uri or f"sqlite:///{work_dir}/mlflow.db",
        "launcher.root": str(work_dir / "shared"),
        f"steps.{workload.tune_step}.with.study.storage": f"journal://{work_dir}/optuna.log",
        f"steps.{workload.tune_step}.with.train.args.epochs": str(epochs),
    }
    argv = [*tunepod_command(), "run", str(SPEC.relative_to(REPO))]
    for key, value in overrides.items():
        argv += ["--set", f"{key}={value}"]
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)  # without --prefect-api, measure the temporary server
    if servers.prefect_api:
        env["PREFECT_API_URL"] = servers.prefect_api
    if servers.stack_home:
        argv += ["--home", str(servers.stack_home)]  # `tunepod run` finds the stack's server and runner
    cpu_before = children_cpu_s()
    launched = time.time()
    with open(log, "wb") as out:
        code = subprocess.run(
            argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
        ).returncode
    exited = time.time()
    cpu_s = children_cpu_s() - cpu_before
    if code != 0:
        raise SideFailed(f"tunepod run exited {code}; log {log}:\n{tail(log)}")
    study_dir = work_dir / "shared" / "jobs" / workload.study
    jobs = tunepod_jobs(study_dir)
    warnings = check_jobs("tunepod", jobs, workload, study_dir)
    events = prefect_events(log.read_text(errors="replace"), launched, workload.stage_step)
    return SideRun("tunepod", launched, exited, jobs, cpu_s, warnings, events=events, log=log)


def tunepod_command() -> list[str]:
    entry_point = Path(sys.executable).with_name("tunepod")
    return [str(entry_point)] if entry_point.exists() else [sys.executable, "-m", "tunepod.cli"]


def tunepod_jobs(study_dir: Path) -> list[JobSpan]:
    """Each trial's job span from the files the local launcher writes (see tunepod.launch.local)."""
    jobs = []
    for job_dir in sorted(study_dir.glob("trial-*")):
        if not job_dir.name.removeprefix("trial-").isdigit():
            continue  # a ``trial-N.stale-T`` folder set aside by the tuner
        exit_file = job_dir / "exit_code"
        end_file = exit_file if exit_file.exists() else job_dir / "result.json"
        jobs.append(
            JobSpan(
                trial=int(job_dir.name.removeprefix("trial-")),
                start=(job_dir / "submission.json").stat().st_mtime,
                end=end_file.stat().st_mtime,
                exit_code=exit_code_of(exit_file),
                has_result=(job_dir / "result.json").exists(),
            )
        )
    return jobs


def exit_code_of(exit_file: Path) -> int | None:
    """The code in a local job's exit file (``<code> <submission id>``), None when it has none."""
    from tunepod.launch.exit_code import parse_exit_file

    parsed = parse_exit_file(exit_file.read_text()) if exit_file.exists() else None
    return parsed[0] if parsed else None


# What `tunepod run` says when it starts a Prefect server for the run (tunepod.cli).
TEMPORARY_SERVER_LINE = "Prefect: a temporary server for this run"
# Prefect's console lines start with the local time of day: "05:59:31.586 | INFO    | prefect - ...".
_PREFECT_LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \| \w+\s*\| (.*)$", re.MULTILINE)


def prefect_markers(stage_step: str) -> dict[str, re.Pattern[str]]:
    return {
        "flow run begins": re.compile(r"Beginning flow run"),
        "stage step done": re.compile(rf"Task run '{re.escape(stage_step)}' - Finished"),
        "flow run done": re.compile(r"^Flow run .* - Finished in state"),
    }


def prefect_events(log_text: str, launched: float, stage_step: str) -> dict[str, float]:
    """The first time each marker appears in Prefect's log, as seconds since the epoch."""
    day = datetime.fromtimestamp(launched).date()
    events: dict[str, float] = {}
    for clock, message in _PREFECT_LINE.findall(log_text):
        for name, pattern in prefect_markers(stage_step).items():
            if name not in events and pattern.search(message):
                moment = datetime.combine(day, datetime.strptime(clock, "%H:%M:%S.%f").time())
                if moment.timestamp() < launched - 60:  # the run went past midnight
                    moment += timedelta(days=1)
                events[name] = moment.timestamp()
    return events


def timeline(run: SideRun) -> dict[str, float]:
    """Seconds between consecutive known moments of a tunepod run, keyed "from -> to"."""
    moments = {"launch": run.launched, **run.events}
    moments["first job starts"] = min(j.start for j in run.jobs)
    moments["last job ends"] = max(j.end for j in run.jobs)
    moments["exit"] = run.exited
    ordered = sorted(moments.items(), key=lambda item: item[1])
    return {f"{a} -> {b}": tb - ta for (a, ta), (b, tb) in itertools.pairwise(ordered)}


# ---------------------------------------------------------------------------------------------- report


def median_of(runs: Sequence[SideRun], num_parallel: int) -> dict[str, float]:
    per_run = [run.metrics(num_parallel) for run in runs]
    return {key: statistics.median(m[key] for m in per_run) for key in per_run[0]}


def print_report(
    workload: Workload, epochs: int, baseline: list[SideRun], tunepod: list[SideRun], servers: Servers
) -> float:
    """Print the comparison and return the median end-to-end ratio tunepod / baseline."""
    base = median_of(baseline, workload.num_parallel)
    tune = median_of(tunepod, workload.num_parallel)
    if servers.stack_home:  # the run and its jobs are the runner's children, not this process's
        del base[CPU_TIME], tune[CPU_TIME]
    ratios = [t.wall_s / b.wall_s for b, t in zip(baseline, tunepod, strict=True)]
    table = Table(
        title=f"{workload.num_trials} digits trials x {epochs} epochs, {workload.num_parallel} at a time, "
        f"torchrun x{workload.procs_per_node} (median of {len(baseline)}, seconds)"
    )
    for column in ("", "baseline", "tunepod", "difference", "ratio"):
        table.add_column(column, justify="left" if not column else "right")
    for key in base:
        ratio = f"{tune[key] / base[key]:.2f}" if base[key] > 0.05 else ""
        table.add_row(key, f"{base[key]:.2f}", f"{tune[key]:.2f}", f"{tune[key] - base[key]:+.2f}", ratio)
    console.print(table)
    console.print(LEGEND)
    fixed = (tune[END_TO_END] - tune[TRIAL_WINDOW]) - (base[END_TO_END] - base[TRIAL_WINDOW])
    per_trial = (tune[TRIAL_WINDOW] - base[TRIAL_WINDOW]) * workload.num_parallel / workload.num_trials
    end_to_end_ratio = statistics.median(ratios)
    console.print(f"end-to-end ratio tunepod / baseline: {end_to_end_ratio:.2f} (median of the runs' ratios)")
    console.print(f"trial-window ratio tunepod / baseline: {tune[TRIAL_WINDOW] / base[TRIAL_WINDOW]:.2f}")
    console.print(f"fixed cost outside the trial window: {fixed:+.1f} s")
    console.print(
        f"per-trial overhead inside the window: {per_trial:+.2f} s of slot time per trial "
        f"(window difference x {workload.num_parallel} slots / {workload.num_trials} trials)"
    )
    print_timeline(tunepod)
    for warning in [w for run in [*baseline, *tunepod] for w in run.warnings]:
        console.print(f"warning: {warning}", style="yellow", markup=False)
    if servers.stack_home:
        console.print(
            f"the local stack in {servers.stack_home} (--stack): its Prefect server, its MLflow server "
            f"{servers.mlflow_uri} and its runner; no server start-up included; no CPU time (the run "
            "and its jobs are processes of the runner's, not of this benchmark's)."
        )
    elif servers.prefect_api:
        console.print(
            f"Prefect: the server at {servers.prefect_api} (--prefect-api); no server start-up included."
        )
    elif all(TEMPORARY_SERVER_LINE in run.log.read_text(errors="replace") for run in tunepod if run.log):
        console.print(
            "Prefect: `tunepod run` started a temporary Prefect server; its start-up (and stop) "
            "is included in tunepod's end-to-end time. Use --prefect-api URL to leave it out."
        )
    else:
        console.print("Prefect: no temporary server seen in the log (a Prefect profile sets an API URL?).")
    return end_to_end_ratio


def print_timeline(tunepod: Sequence[SideRun]) -> None:
    per_run = [timeline(run) for run in tunepod]
    keys = [key for key in per_run[0] if all(key in t for t in per_run)]
    table = Table(title="where tunepod's time goes (median seconds; moments from Prefect's log, job dirs)")
    table.add_column("from -> to")
    table.add_column("seconds", justify="right")
    for key in keys:
        table.add_row(key, f"{statistics.median(t[key] for t in per_run):.2f}")
    console.print(table)


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time `tunepod run` against bare torchrun on the same fixed-parameter digits trials."
    )
    parser.add_argument("--epochs", type=int, default=12, help="epochs per trial (default 12)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side, alternating (default 1)")
    parser.add_argument("--prefect-api", metavar="URL", help="a running Prefect server's API URL")
    parser.add_argument(
        "--mlflow-uri",
        metavar="URL",
        help="a running MLflow tracking server (with --prefect-api: the local stack `tunepod up` starts)",
    )
    parser.add_argument(
        "--stack",
        metavar="HOME",
        type=Path,
        help="the local stack `tunepod up --home HOME` runs: its Prefect and MLflow servers and its runner",
    )
    parser.add_argument(
        "--max-ratio", type=float, help="exit 1 when the end-to-end ratio tunepod / baseline exceeds it"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp folders (logs, job dirs, stores)")
    parser.add_argument("--baseline-child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.repeats < 1:
        parser.error("--epochs and --repeats must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.baseline_child:
        baseline_child(args.baseline_child, Workload(**json.loads(args.workload)))
        return 0
    workload = read_workload(args.epochs)
    servers = Servers.of(args)
    root = Path(tempfile.mkdtemp(prefix="tunepod-overhead-"))
    load_before = os.getloadavg()[0]
    runs: dict[str, list[SideRun]] = {"baseline": [], "tunepod": []}
    try:
        for repeat in range(args.repeats):
            # Alternate which side goes first, so a drift of the machine (caches, a noisy
            # neighbour) does not always favour the same side.
            order = ["baseline", "tunepod"] if repeat % 2 == 0 else ["tunepod", "baseline"]
            for side in order:
                work_dir = root / f"{side}-{repeat}"
                work_dir.mkdir()
                if side == "baseline":
                    run = run_baseline(workload, work_dir)
                else:
                    run = run_tunepod(workload, work_dir, args.epochs, servers)
                runs[side].append(run)
                console.print(f"repeat {repeat + 1}/{args.repeats}: {side} {run.wall_s:.1f} s")
    except SideFailed as exc:
        console.print(f"benchmark failed: {exc}", style="bold red", markup=False)
        console.print(f"temp folder kept: {root}")
        return 1
    ratio = print_report(workload, args.epochs, runs["baseline"], runs["tunepod"], servers)
    # Other work on the machine skews both sides; the reader should know how busy it was.
    console.print(
        f"machine: {os.cpu_count()} CPUs, 1-minute load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after"
    )
    if load_before > BUSY_LOAD:
        console.print(
            f"warning: the machine was busy before the benchmark started (load {load_before:.1f}); "
            "the jobs compete with that work, so rerun on a quiet machine to compare numbers",
            style="yellow",
        )
    if args.keep:
        console.print(f"temp folder kept: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    if args.max_ratio is not None and ratio > args.max_ratio:
        console.print(f"[bold red]end-to-end ratio {ratio:.2f} exceeds --max-ratio {args.max_ratio}[/]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
