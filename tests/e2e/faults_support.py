"""What the real-fault tests (``test_faults.py``) share: a small spec, ``tunepod run`` as a process of its
own, bounded waits, and readers of what a study left behind (Optuna journal, MLflow runs, job dirs,
the process table and the Slurm queue).

Each ``tunepod run`` runs as a user runs it: ``python -m tunepod.cli run SPEC`` from the repository
root, in a session of its own (so a test can SIGKILL its whole process group), its output in a file
under the test's temp folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from mlflow import MlflowClient
from optuna.trial import FrozenTrial, TrialState

from tunepod.hpo.study import make_storage
from tunepod.launch.base import SUBMISSION_ID_ENV
from tunepod.launch.local.processes import live_processes
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import Submission, read_submission
from tunepod.runtime import Result, read_reports, read_result
from tunepod.runtime.contract import RESULT_FILE_ENV

REPO = Path(__file__).resolve().parents[2]
TRAINER = REPO / "tests" / "fixtures" / "trainers" / "quadratic.py"
COLLECTIVE_TRAINER = REPO / "tests" / "fixtures" / "trainers" / "collective.py"
NODES_LAUNCHER = {"partition": "nodes", "exclusive": True}
"""Slurm launcher options for trials on the cluster's namespaced nodes, each node the trial's alone
(``exclusive``, as GPU nodes are: else Slurm packs two trials' one-core tasks onto the same nodes)."""
MULTI_NODE = {"trainer": COLLECTIVE_TRAINER, "args": {"stoppable": 1}, "launcher_options": NODES_LAUNCHER}
"""What makes a Slurm study's trials run ``collective.py`` on the namespaced nodes, stopping when asked
(a pause or an exploit); with ``train.resources.num_nodes`` > 1."""
DATA = REPO / "tests" / "fixtures" / "specs"
PIPELINE = "faults"
EXPERIMENT = "faults"
STUDY = "quad"
METRIC = "score"
#: Bound on one ``tunepod run`` (and on each wait): against a hang, never a speed check.
RUN_LIMIT_S = 240.0
WAIT_LIMIT_S = 120.0
_POLL_S = 0.2


# ------------------------------------------------------------------------------------------ the spec


@dataclass(frozen=True)
class FaultStudy:
    """One test's pipeline: stage a small folder, then tune the quadratic trainer (3 trials, 2 at a
    time: a second wave runs after the fault; random sampler with a fixed seed, no pruner), every
    store under ``tmp``."""

    tmp: Path
    launcher: str
    tracking_uri: str
    num_trials: int = 3
    num_parallel: int = 2
    epochs: int = 6
    sleep_s: float | None = 0.5
    """The trainer's pause per epoch; None where the space tunes it."""
    trainer: Path = TRAINER
    args: Mapping[str, Any] = field(default_factory=dict)
    """More trainer parameters, besides epochs and sleep_s."""
    train: Mapping[str, Any] = field(default_factory=dict)
    """More of the spec's ``train`` section (resources, max_restarts, hang_timeout_s)."""
    storage_url: str | None = None
    """The Optuna storage (e.g. a PostgreSQL database); default: a journal file under ``tmp``."""
    tune: Mapping[str, Any] = field(default_factory=dict)
    """More of the tune step (a pruner, a space, trials to enqueue), over the defaults."""
    tracking: Mapping[str, Any] = field(default_factory=dict)
    """More of the spec's ``tracking`` section (``runs_ahead``)."""
    launcher_options: Mapping[str, Any] = field(default_factory=dict)
    """More of the launcher's section (a Slurm partition), over the defaults."""

    @property
    def spec(self) -> Path:
        return self.tmp / "spec.yaml"

    @property
    def root(self) -> Path:
        return self.tmp / "shared"

    @property
    def jobs_dir(self) -> Path:
        return self.root / "jobs" / STUDY

    @property
    def journal(self) -> Path:
        return self.tmp / "optuna.log"

    @property
    def storage(self) -> str:
        return self.storage_url or f"journal://{self.journal}"

    def write(self) -> FaultStudy:
        launcher: dict[str, Any] = {"kind": self.launcher, "root": str(self.root)}
        if self.launcher == "slurm":
            launcher |= {"python": sys.executable, "poll_cache_s": 0.2}
        else:
            launcher |= {"cancel_grace_s": 5}
        launcher |= self.launcher_options
        spec = {
            "name": PIPELINE,
            "tracking": {"uri": self.tracking_uri, "experiment": EXPERIMENT, **self.tracking},
            "launcher": launcher,
            "steps": {
                "data": {"uses": "stage", "with": {"source": str(DATA), "target": "fsx:///datasets/x"}},
                "search": {
                    "uses": "tune",
                    "needs": ["data"],
                    "with": {
                        "train": {
                            "entrypoint": str(self.trainer),
                            "args": {"epochs": self.epochs, **self._sleep, **self.args},
                            **self.train,
                        },
                        "study": {"name": STUDY, "storage": self.storage, "metric": METRIC},
                        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
                        "num_trials": self.num_trials,
                        "num_parallel": self.num_parallel,
                        "sampler": "random",
                        "seed": 7,
                        "poll_s": 0.2,
                        **self.tune,
                    },
                },
            },
        }
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.spec.write_text(yaml.safe_dump(spec, sort_keys=False))
        return self

    @property
    def _sleep(self) -> dict[str, float]:
        return {} if self.sleep_s is None else {"sleep_s": self.sleep_s}

    # -------------------------------------------------------------------------------------- reading

    def job_dir(self, number: int) -> Path:
        return self.jobs_dir / f"trial-{number}"

    def job_dirs(self) -> dict[int, Path]:
        """Every trial's job dir so far (never a ``.stale-*`` one), by trial number."""
        if not self.jobs_dir.is_dir():
            return {}
        found = {}
        for path in self.jobs_dir.glob("trial-*"):
            number = path.name.removeprefix("trial-")
            if number.isdigit():
                found[int(number)] = path
        return dict(sorted(found.items()))

    def started(self) -> dict[int, Path]:
        """The trials whose training script has started (the trainer's starts.log exists)."""
        return {n: d for n, d in self.job_dirs().items() if (d / "starts.log").exists()}

    def trials(self) -> list[FrozenTrial]:
        """The study's trials, as its storage holds them (read with optuna itself)."""
        study = optuna.load_study(study_name=STUDY, storage=make_storage(self.storage))
        return sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)


@dataclass(frozen=True)
class RankPlace:
    """One line of ``nodes.log``: where one rank of one start of the trainer ran."""

    started_at: float
    rank: int
    slurmd_nodename: str
    hostname: str


def placements(job_dir: Path) -> dict[float, list[RankPlace]]:
    """Every start of the trial's script, by start time: where each of its ranks ran."""
    starts_by_time: dict[float, list[RankPlace]] = {}
    for line in (job_dir / "nodes.log").read_text().splitlines():
        started_at, rank, node, host = line.split()
        place = RankPlace(float(started_at), int(rank), node, host)
        starts_by_time.setdefault(place.started_at, []).append(place)
    return {at: sorted(ranks, key=lambda r: r.rank) for at, ranks in sorted(starts_by_time.items())}


def nodes_of(ranks: list[RankPlace]) -> list[str]:
    """The nodes a start ran on, in rank order, each once."""
    return list(dict.fromkeys(rank.slurmd_nodename for rank in ranks))


def sqlite_tracking(tmp: Path) -> str:
    return f"sqlite:///{tmp / 'mlflow.db'}"


def starts(job_dir: Path) -> int:
    """How often the trial's training script started (one line per start)."""
    return len((job_dir / "starts.log").read_text().splitlines())


def submission(job_dir: Path) -> Submission:
    record = read_submission(JobPaths(job_dir))
    assert record is not None, f"{job_dir} has no submission record"
    return record


def result(job_dir: Path) -> Result:
    found = read_result(JobPaths(job_dir).result)
    assert found is not None, f"{job_dir} has no result.json"
    return found


# ------------------------------------------------------------------------------------------ tunepod run


@dataclass
class Orchestrator:
    """One ``tunepod run`` process (the leader of its own process group)."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pgid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, chars: int = 6000) -> str:
        return f"--- output of `tunepod run` ({self.name}), last {chars} chars ---\n{self.output()[-chars:]}"

    def is_running(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout_s: float = RUN_LIMIT_S) -> int:
        """Its exit code; fails the test (with its output) when it has not exited after ``timeout_s``."""
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"`tunepod run` ({self.name}) did not finish within {timeout_s:.0f}s\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group: the CLI, Prefect's threads, every child of the orchestrator.
        (Jobs are not in it: the launchers start them in sessions of their own, or Slurm runs them.)"""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        self.process.wait(timeout=30)


@dataclass
class Tunepod:
    """Starts ``tunepod run`` on one study's spec; ``close`` kills whatever a failed test left running."""

    study: FaultStudy
    env: Mapping[str, str]
    started: list[Orchestrator] = field(default_factory=list)

    def start(self, name: str) -> Orchestrator:
        log = self.study.tmp / f"tunepod-run-{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "tunepod.cli", "run", str(self.study.spec)],
                cwd=REPO,
                env=dict(self.env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        orchestrator = Orchestrator(name, process, log)
        self.started.append(orchestrator)
        return orchestrator

    def run(self, name: str) -> Orchestrator:
        """A ``tunepod run`` to its end; asserts it exited 0."""
        orchestrator = self.start(name)
        code = orchestrator.wait()
        assert code == 0, f"`tunepod run` ({name}) exited {code}\n{orchestrator.tail()}"
        return orchestrator

    def close(self) -> None:
        for orchestrator in self.started:
            if orchestrator.is_running():
                orchestrator.kill()
        stop_study_jobs(self.study)


MakeRuns = Callable[..., Tunepod]
"""The ``runs`` fixture (``conftest.py``): ``runs(study, **env)`` -> a ``Tunepod`` on the study's spec."""


def wait_for(
    condition: Callable[[], bool],
    what: str,
    *,
    running: Orchestrator | None = None,
    timeout_s: float = WAIT_LIMIT_S,
) -> None:
    """Poll ``condition`` until it holds; fail with ``what`` after ``timeout_s`` (a bound against a hang,
    not a speed check), or as soon as ``running`` (an orchestrator the wait depends on) has exited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if running is not None and not running.is_running():
            pytest.fail(
                f"`tunepod run` ({running.name}) exited {running.process.returncode} while waiting for "
                f"{what}\n{running.tail()}"
            )
        if time.monotonic() > deadline:
            tail = f"\n{running.tail()}" if running is not None else ""
            pytest.fail(f"still waiting for {what} after {timeout_s:.0f}s{tail}")
        time.sleep(_POLL_S)


# ------------------------------------------------------------------------------------------ checks


def assert_study_complete(study: FaultStudy) -> dict[int, FrozenTrial]:
    """Exactly ``num_trials`` trials, numbered 0..n-1, every one COMPLETE (no pruner: none may fail),
    and no two with the same parameters (a rerun or a second orchestrator continues the seeded
    sampler's sequence instead of suggesting the first trials again)."""
    trials = study.trials()
    described = [(t.number, t.state.name, t.value) for t in trials]
    assert [t.number for t in trials] == list(range(study.num_trials)), described
    assert all(t.state is TrialState.COMPLETE for t in trials), described
    suggested = [tuple(sorted(t.params.items())) for t in trials]
    assert len(set(suggested)) == len(suggested), f"repeated suggestions: {suggested}"
    return {t.number: t for t in trials}


def assert_trained_once(study: FaultStudy) -> None:
    """Every trial's script started exactly once (trained from scratch once, never relaunched), and
    its job dir holds the first submission only."""
    dirs = study.job_dirs()
    assert sorted(dirs) == list(range(study.num_trials)), sorted(dirs)
    launches = {n: starts(d) for n, d in dirs.items()}
    assert set(launches.values()) == {1}, f"starts per trial (want 1 each): {launches}"
    attempts = {n: submission(d).attempt for n, d in dirs.items()}
    assert set(attempts.values()) == {1}, f"submission attempt per trial (want 1 each): {attempts}"
    stale = sorted(p.name for p in study.jobs_dir.glob("trial-*.stale-*"))
    assert not stale, f"job dirs set aside as stale: {stale}"


def assert_runs_made_ahead_were_taken_or_deleted(study: FaultStudy) -> int:
    """No run made ahead of a trial (``tracking.runs_ahead``) is left untaken: every one is a trial's
    run now, or deleted. Returns how many trials' runs were made ahead."""
    client = MlflowClient(study.tracking_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    untaken = client.search_runs([experiment.experiment_id], "tags.`tunepod.reserved` = 'true'")
    assert untaken == [], [run.info.run_id for run in untaken]
    taken = client.search_runs(
        [experiment.experiment_id], f"tags.`tunepod.reserved` = 'false' AND tags.`tunepod.study` = '{STUDY}'"
    )
    return len(taken)


def assert_tracked_once(study: FaultStudy, trials: Mapping[int, FrozenTrial]) -> None:
    """One MLflow run per trial, found by its tags, holding each epoch's reported ``score`` exactly once.

    The history of ``score`` must be the trial's metrics file, point for point: steps 0..epochs-1, each
    once, each at the time the job reported it (a second training, or a report mirrored twice under
    another timestamp, would add a point), and the last one is the trial's objective value.
    """
    client = MlflowClient(study.tracking_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None, f"no MLflow experiment {EXPERIMENT!r} in {study.tracking_uri}"
    runs = client.search_runs(
        [experiment.experiment_id], f"tags.`tunepod.study` = '{STUDY}'", max_results=1000
    )
    by_trial: dict[int, list[Any]] = {}
    for run in runs:
        by_trial.setdefault(int(run.data.tags["tunepod.trial"]), []).append(run)
    counts = {n: len(found) for n, found in sorted(by_trial.items())}
    assert counts == dict.fromkeys(range(study.num_trials), 1), f"MLflow runs per trial: {counts}"

    for number, (run,) in sorted(by_trial.items()):
        assert run.data.tags.get("tunepod.key") == f"{STUDY}/trial-{number}", run.data.tags
        assert run.data.tags.get("tunepod.state") == "COMPLETE", (number, run.data.tags)
        assert run.info.status == "FINISHED", (number, run.info.status)
        reports = read_reports(JobPaths(study.job_dir(number)).metrics)
        assert [r.step for r in reports] == list(range(study.epochs)), (number, reports)
        reported = [(r.step, int(r.time * 1000), r.metrics[METRIC]) for r in reports]
        history = sorted(
            (m.step, m.timestamp, m.value) for m in client.get_metric_history(run.info.run_id, METRIC)
        )
        assert history == reported, (
            f"trial {number}: MLflow must hold each reported epoch once and nothing else;\n"
            f"history {history}\nreports {reported}"
        )
        assert history[-1][2] == pytest.approx(trials[number].value), (number, history[-1])


def study_job_ids(study: FaultStudy) -> dict[int, str]:
    """The backend job id each trial's job dir records."""
    return {
        n: record.job_id
        for n, d in study.job_dirs().items()
        if (record := read_submission(JobPaths(d))) is not None and record.job_id is not None
    }


def queued(job_ids: list[str]) -> list[str]:
    """Lines ``<id> <state>`` of the jobs among ``job_ids`` that Slurm still lists (queued or running)."""
    if not job_ids:
        return []
    listed = subprocess.run(
        ["squeue", "-h", "-o", "%i %T", "-j", ",".join(job_ids)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if listed.returncode != 0 and "Invalid job id" not in listed.stderr:
        pytest.fail(f"squeue failed: {listed.stderr}")
    return [line for line in listed.stdout.splitlines() if line.strip()]


def study_processes(study: FaultStudy) -> list[int]:
    """Live processes of the study's jobs: those carrying the submission id a job dir records, or the
    result file of one of the study's job dirs (whatever launched them)."""
    submissions = {
        record.submission_id
        for d in study.job_dirs().values()
        if (record := read_submission(JobPaths(d))) is not None
    }
    needles = [f"\0{SUBMISSION_ID_ENV}={s}\0".encode() for s in submissions]
    needles.append(f"\0{RESULT_FILE_ENV}={study.jobs_dir}/".encode())
    found = []
    for pid, _ in live_processes():
        try:
            environ = b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if any(needle in environ for needle in needles):
            found.append(pid)
    return found


def assert_nothing_left(study: FaultStudy) -> None:
    """No job of the study still runs: no local process of it, and (Slurm) no entry in the queue."""
    assert study_processes(study) == [], "processes of the study's jobs still live"
    if study.launcher == "slurm":
        assert queued(list(study_job_ids(study).values())) == [], "the study's Slurm jobs are still queued"


def stop_study_jobs(study: FaultStudy) -> None:
    """Teardown after a failed test: cancel the study's Slurm jobs, SIGKILL its local processes."""
    if study.launcher == "slurm":
        for job_id in study_job_ids(study).values():
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30, check=False)
    for pid in study_processes(study):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue


def reported_steps(study: FaultStudy) -> int:
    """How many reports the study's jobs have written so far, all trials together."""
    return sum(len(read_reports(JobPaths(d).metrics)) for d in study.job_dirs().values())
