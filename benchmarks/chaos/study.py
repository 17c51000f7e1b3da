"""What the soak runs and reads: the study's spec, the processes it starts (``tunepod run``, ``mlflow
server``), and what a trial's job dir says about its current job.

Every process the soak starts carries ``MARKER_ENV`` (``tunepod run`` passes its environment on to
local jobs and ``sbatch`` exports it to Slurm jobs), so anything the soak left behind is found by that
variable in ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tunepod.launch.base import SUBMISSION_ID_ENV
from tunepod.launch.local.processes import live_processes
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import Submission, read_submission
from tunepod.runtime import read_reports

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).with_name("trainer.py")
DATA = REPO / "tests" / "fixtures" / "specs"
MARKER_ENV = "TUNEPOD_CHAOS_SOAK"
#: The partition of the namespaced nodes (``scripts/slurm-up --nodes N``): multi-node trials run there.
NODE_PARTITION = "nodes"
STAGE_STEP = "data"
#: What Prefect logs once the stage step ran, after the pipeline's MLflow run was opened.
STAGE_TASK_LOGGED = f"Task run '{STAGE_STEP}'"
EXPERIMENT = "chaos"
METRIC = "score"
#: One 3 s attempt per MLflow request: an outage shows at once and tunepod's outbox retries later.
MLFLOW_CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "3"}
#: Bound on an MLflow server start (one uvicorn worker: ~9 s on two busy cores); against a hang only.
SERVER_START_LIMIT_S = 120.0


class SoakError(Exception):
    """Something the soak itself needs failed (a server that never starts): not a tunepod verdict."""


def free_port() -> int:
    """A port free on 127.0.0.1 now (whoever binds it next should do so at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# ------------------------------------------------------------------------------------------ the spec


@dataclass(frozen=True)
class ChaosStudy:
    """One launcher's pipeline: stage a small folder, then tune the two-rank gloo trainer (random
    sampler, fixed seed, no pruner), every store under ``folder``. A Slurm study of ``num_nodes`` > 1
    runs each trial as one job over that many namespaced nodes (partition ``nodes``), two ranks on
    each; otherwise on this host's node (partition ``debug``, the default)."""

    folder: Path
    launcher: str
    tracking_uri: str
    num_trials: int
    num_parallel: int
    epochs: int
    sleep_s: float
    max_restarts: int
    num_nodes: int = 1

    @property
    def name(self) -> str:
        return f"chaos-{self.launcher}"

    @property
    def spec(self) -> Path:
        return self.folder / "spec.yaml"

    @property
    def root(self) -> Path:
        return self.folder / "shared"

    @property
    def jobs_dir(self) -> Path:
        return self.root / "jobs" / self.name

    @property
    def journal(self) -> Path:
        return self.folder / "optuna.log"

    def write(self) -> ChaosStudy:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.spec.write_text(yaml.safe_dump(self._spec(), sort_keys=False))
        return self

    def _spec(self) -> dict[str, Any]:
        launcher: dict[str, Any] = {"kind": self.launcher, "root": str(self.root)}
        resources = {"procs_per_node": 2}
        if self.launcher == "slurm":
            launcher |= {"python": sys.executable, "poll_cache_s": 0.2}
            if self.num_nodes > 1:
                launcher["partition"] = NODE_PARTITION
                resources["num_nodes"] = self.num_nodes
        else:
            launcher |= {"cancel_grace_s": 5}
        train = {
            "entrypoint": str(TRAINER),
            "args": {"epochs": self.epochs, "sleep_s": self.sleep_s},
            "resources": resources,
            "max_restarts": self.max_restarts,
        }
        tune = {
            "train": train,
            "study": {"name": self.name, "storage": f"journal://{self.journal}", "metric": METRIC},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "num_trials": self.num_trials,
            "num_parallel": self.num_parallel,
            "sampler": "random",
            "seed": 7,
            "poll_s": 0.2,
        }
        stage = {"source": str(DATA), "target": "fsx:///datasets/x"}
        return {
            "name": self.name,
            "tracking": {"uri": self.tracking_uri, "experiment": EXPERIMENT},
            "launcher": launcher,
            "steps": {
                STAGE_STEP: {"uses": "stage", "with": stage},
                "search": {"uses": "tune", "needs": [STAGE_STEP], "with": tune},
            },
        }

    def job_dirs(self) -> dict[int, Path]:
        """Every trial's job dir so far (never a ``.stale-*`` one), by trial number."""
        found = {}
        for path in self.jobs_dir.glob("trial-*") if self.jobs_dir.is_dir() else []:
            number = path.name.removeprefix("trial-")
            if number.isdigit():
                found[int(number)] = path
        return dict(sorted(found.items()))


# ------------------------------------------------------------------------------------ a trial's job


@dataclass(frozen=True)
class TrialJob:
    """A trial's current job as its job dir describes it."""

    number: int
    paths: JobPaths
    submission: Submission

    @property
    def finished(self) -> bool:
        return self.paths.result.exists()

    def reported(self) -> int:
        return len(read_reports(self.paths.metrics))


def trial_jobs(study: ChaosStudy) -> list[TrialJob]:
    """The trials whose job was sent (the record holds a backend id) and has not written its result."""
    jobs = []
    for number, job_dir in study.job_dirs().items():
        paths = JobPaths(job_dir)
        with contextlib.suppress(Exception):  # a record being replaced: skip it this round
            record = read_submission(paths)
            if record is not None and record.job_id is not None and not paths.result.exists():
                jobs.append(TrialJob(number, paths, record))
    return jobs


def carrying(name: str, value: str) -> list[int]:
    """Live processes whose environment holds ``name=value`` (never this process)."""
    needle = f"\0{name}={value}\0".encode()
    found = []
    for pid, _ in live_processes():
        try:
            environ = b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ and pid != os.getpid():
            found.append(pid)
    return found


def job_processes(job: TrialJob) -> list[int]:
    return carrying(SUBMISSION_ID_ENV, job.submission.submission_id)


def kill_groups(pids: list[int], owned: set[int]) -> list[int]:
    """SIGKILL the process group of each of ``pids`` whose leader is in ``owned`` (a group led by
    something else, such as slurmstepd, is never killed whole), and each pid itself. Returns the
    groups killed."""
    groups = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            group = os.getpgid(pid)
            if group in owned and group not in groups:
                os.killpg(group, signal.SIGKILL)
                groups.append(group)
            os.kill(pid, signal.SIGKILL)
    return groups


# ------------------------------------------------------------------------------------- the processes


@dataclass
class Orchestrator:
    """``tunepod run`` on the study's spec, as a user runs it, in a session of its own."""

    study: ChaosStudy
    env: Mapping[str, str]
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    exit_codes: list[int] = field(default_factory=list)

    @property
    def log(self) -> Path:
        return self.study.folder / f"tunepod-run-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        argv = [sys.executable, "-m", "tunepod.cli", "run", str(self.study.spec)]
        argv += ["--home", str(self.study.folder / "home")]  # never the local stack of whoever runs it
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                argv,
                cwd=REPO,
                env=dict(self.env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def exited(self) -> int | None:
        """The exit code of the current run once it has exited, else None."""
        return None if self.process is None else self.process.poll()

    def kill(self) -> None:
        """SIGKILL the whole process group: the CLI, Prefect, the tuner's threads, their children."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.exit_codes.append(self.process.wait(timeout=60))
        self.process = None

    def finish(self) -> int:
        """Record the exit code of a run that exited by itself."""
        assert self.process is not None
        code = self.process.wait()
        self.exit_codes.append(code)
        self.process = None
        return code

    def past_startup(self) -> bool:
        """Whether the current run has opened its MLflow run and staged the data (it logged the stage
        task): a run still starting up needs MLflow to answer (see ``FaultDriver``)."""
        return self.process is not None and STAGE_TASK_LOGGED in self.log.read_text(errors="replace")

    def tail(self, chars: int = 4000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.log}, last {chars} chars ---\n{text[-chars:]}"


class MlflowServer:
    """``mlflow server`` with a SQLite store under ``folder``, restartable on the same port and store.

    One uvicorn worker (the default four take twice as long to start on two cores); no job-execution
    workers, which tunepod never uses. It runs in a session of its own, so ``kill`` takes the CLI,
    uvicorn and its worker down at once, as a crashed or OOM-killed server goes.
    """

    def __init__(self, folder: Path, env: Mapping[str, str]) -> None:
        self.folder = folder
        self.env = {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        """Start the server; returns at once (``ready`` says when it answers)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}"]
        argv += ["--artifacts-destination", str(self.folder / "artifacts"), "--workers", "1"]
        with (self.folder / "mlflow-server.log").open("ab") as log:
            self.process = subprocess.Popen(
                argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.starts += 1

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_LIMIT_S
        while not self.ready():
            if self.process is None or self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.folder / "mlflow-server.log").read_text(errors="replace")[-3000:]
                raise SoakError(f"mlflow server on port {self.port} did not start:\n{log}")
            time.sleep(0.2)

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).is_success
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)
        self.process = None


@contextlib.contextmanager
def mlflow_server(folder: Path, env: Mapping[str, str]) -> Iterator[MlflowServer]:
    """A started, answering server; killed on exit whatever state the soak left it in."""
    server = MlflowServer(folder, env)
    try:
        server.start()
        server.wait_ready()
        yield server
    finally:
        server.kill()
