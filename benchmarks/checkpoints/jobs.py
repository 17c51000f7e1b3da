"""Start, watch and kill the benchmark's training jobs (``trainer.py`` under torchrun, 2 ranks, gloo),
and turn what they write into the stall and resume figures."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.chaos.study import carrying
from tunepod import runtime

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).resolve().with_name("trainer.py")
MARKER_ENV = "TUNEPOD_BENCH_CHECKPOINTS_JOB"
#: Bytes of state per parameter: the float32 weight and AdamW's two float32 moments.
BYTES_PER_PARAM = 12
LAYERS = 4
NPROC = 2
POLL_S = 0.02
#: Resume methods: the baseline, then tunepod's two ways of loading.
RESUME_METHODS = ("torch.save", "tunepod", "tunepod-sharded")
STALL_METHODS = (
    "none", "torch.save", "torch.save+fsync", "tunepod", "tunepod-sharded", "tunepod-async",
    "tunepod-async-process", "tunepod-memory", "tunepod-memory-sharded", "copy",
)  # fmt: skip
#: Where the memory tier's folders go: node memory, as checkpoints.memory_dir's default.
SHM = Path("/dev/shm")


class SideFailed(Exception):
    """A job did not do what it was started for; the message says where its log is."""


def model_shape(megabytes: float) -> tuple[int, int]:
    """``(width, layers)`` of the trainer's MLP whose state (weights and AdamW moments) is ~``megabytes``."""
    params = megabytes * 1e6 / BYTES_PER_PARAM
    return max(8, round(math.sqrt(params / LAYERS))), LAYERS


@dataclass
class Job:
    """One torchrun job of the trainer; every process it starts carries ``marker`` in its environment."""

    name: str
    folder: Path
    marker: str
    process: subprocess.Popen[bytes]
    launched: float
    log: Path
    memory_dir: Path
    """The memory tier's folders of the job (its ranks' stand-in nodes'), removed by ``kill``: a
    killed job leaves them behind, as a lost node's memory would be."""

    def wait_for(self, path: Path, timeout_s: float) -> dict[str, Any]:
        """The JSON at ``path`` once the job has written it; ``SideFailed`` if the job exits first or
        takes longer than ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if self.process.poll() is not None:
                raise SideFailed(
                    f"job {self.name} exited {self.process.returncode}; log {self.log}:\n{tail(self.log)}"
                )
            if time.monotonic() > deadline:
                raise SideFailed(f"job {self.name} wrote no {path.name} in {timeout_s:.0f} s; log {self.log}")
            time.sleep(POLL_S)
        return dict(json.loads(path.read_text()))

    def kill(self) -> float:
        """SIGKILL every process group of the job (torchrun puts each rank in a session of its own);
        return the moment of the kill (time.time()), once every process is gone."""
        pids = carrying(MARKER_ENV, self.marker)
        killed_at = time.time()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while carrying(MARKER_ENV, self.marker) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        shutil.rmtree(self.memory_dir, ignore_errors=True)
        return killed_at


def launch(name: str, folder: Path, params: dict[str, Any], launcher: str) -> Job:
    """Start the trainer with the training contract's variables, as a tunepod launcher sets them."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = f"{name}-{uuid.uuid4().hex[:8]}"
    memory_dir = SHM / f"tunepod-bench-{marker}" if SHM.is_dir() else folder / "memory"
    params = params | {"memory_dir": str(memory_dir)}
    env = {
        **os.environ,
        runtime.PARAMS_ENV: json.dumps(params, sort_keys=True),
        runtime.DATA_DIR_ENV: str(folder / "data"),
        runtime.CHECKPOINT_DIR_ENV: str(folder / "checkpoints"),
        runtime.RESULT_FILE_ENV: str(folder / "result.json"),
        runtime.METRICS_FILE_ENV: str(folder / "metrics.jsonl"),
        runtime.TRIAL_ENV: name,
        runtime.KEEP_CHECKPOINTS_ENV: "2",
        MARKER_ENV: marker,
        "OMP_NUM_THREADS": "1",  # what torchrun sets for more than one process per node
        "PYTHONPATH": str(REPO),
    }
    log = folder / f"{name}.log"
    with open(log, "ab") as out:
        launched = time.time()
        if launcher == "torchrun":
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(NPROC),
            ]
            process = subprocess.Popen(
                [*argv, str(TRAINER)], cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        else:
            process = direct_ranks(env, out)
    return Job(name, folder, marker, process, launched, log, memory_dir)


def direct_ranks(env: dict[str, str], out: Any) -> subprocess.Popen[bytes]:
    """The ranks started without torchrun's agent, with the variables it would set (``--launcher
    direct``: the agent's own start-up left out). Returns rank 0; rank 1 carries the same marker."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shared = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(NPROC)}
    shared |= {
        "LOCAL_WORLD_SIZE": str(NPROC),
        "GROUP_RANK": "0",
        "ROLE_RANK": "0",
        "ROLE_WORLD_SIZE": str(NPROC),
    }
    processes = []
    for rank in range(NPROC):
        ranked = {**env, **shared, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        processes.append(
            subprocess.Popen(
                [sys.executable, str(TRAINER)],
                cwd=REPO,
                env=ranked,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    return processes[0]


def tail(log: Path, lines: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---------------------------------------------------------------------------------------------- stall


@dataclass(frozen=True)
class StallFigures:
    """One method's stalls and steps at one state size, seconds."""

    size_mb: float
    method: str
    calls: list[float]
    first: float
    steps: list[float]
    drains: list[float]
    bytes: int


@dataclass
class ResumeFigures:
    """One resume: moments (time.time()) from the kill to the first step after it."""

    size_mb: float
    method: str
    killed: float
    relaunched: float
    times: dict[str, float]
    step: int

    def phases(self) -> dict[str, float]:
        t = self.times
        return {
            "kill -> relaunch": self.relaunched - self.killed,
            "process start": t["started"] - self.relaunched,
            "imports": t["imported"] - t["started"],
            "rendezvous": t["rendezvous"] - t["imported"],
            "model build": t["built"] - t["rendezvous"],
            "checkpoint load": t["loaded"] - t["built"],
            "first step": t["first_step"] - t["loaded"],
            "kill -> first step": t["first_step"] - self.killed,
        }


@dataclass
class JobsReport:
    stall: list[StallFigures] = field(default_factory=list)
    resumes: list[ResumeFigures] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def trainer_params(megabytes: float, batch: int) -> dict[str, Any]:
    width, layers = model_shape(megabytes)
    return {"width": width, "layers": layers, "batch": batch}


def run_jobs(
    folder: Path,
    stall_mbs: Sequence[float],
    resume_mbs: Sequence[float],
    *,
    interval: int,
    saves: int,
    rounds: int,
    resume_repeats: int,
    resume_methods: Sequence[str],
    batch: int,
    launcher: str,
    timeout_s: float,
) -> JobsReport:
    """For each size of ``stall_mbs`` the stall job, whose checkpoints the first resume chain of its
    size starts from when it is one of ``resume_mbs`` (then at once, so that no two jobs train at
    the same time), then the other resume chains: for each size a job that saves and is killed, and
    the chain of resumes, each resume job killed after its first step, which is the kill the next
    one is timed from."""
    report = JobsReport()
    chained: set[float] = set()
    for size in stall_mbs:
        params = trainer_params(size, batch) | {"phase": "stall", "methods": list(STALL_METHODS)}
        params |= {"interval": interval, "saves": saves, "rounds": rounds}
        job = stall_job(folder, size, params, launcher, timeout_s, report)
        if job is None:
            continue
        if size in resume_mbs and resume_repeats > 0 and size not in chained:
            chained.add(size)
            resume_into(report, folder, size, batch, launcher, timeout_s, job, resume_methods, 0)
        else:
            job.kill()
    for repeat in range(resume_repeats):
        for size in resume_mbs:
            if repeat == 0 and size in chained:
                continue
            resume_into(report, folder, size, batch, launcher, timeout_s, None, resume_methods, repeat)
    return report


def stall_job(
    folder: Path, size: float, params: dict[str, Any], launcher: str, timeout_s: float, report: JobsReport
) -> Job | None:
    """Run the stall job of ``size`` to its ready marker and add its figures to ``report``; the job,
    still running, or ``None`` (killed, its failure in ``report``)."""
    job = launch("stall", folder / f"size-{size:g}", params, launcher)
    try:
        job.wait_for(job.folder / "checkpoints" / "ready.json", timeout_s)
    except SideFailed as exc:
        report.failures.append(f"stall {size:g} MB: {exc}")
        job.kill()
        return None
    stall = json.loads((job.folder / "checkpoints" / "stall.json").read_text())
    report.stall += [
        StallFigures(
            size,
            m,
            stall["calls"][m],
            stall["first"][m],
            stall["steps"][m],
            stall["drains"][m],
            stall["bytes"][m],
        )
        for m in STALL_METHODS
    ]
    return job


def resume_into(
    report: JobsReport,
    folder: Path,
    size: float,
    batch: int,
    launcher: str,
    timeout_s: float,
    running: Job | None,
    methods: Sequence[str],
    repeat: int,
) -> None:
    """One resume chain of ``size`` (from ``running``, else a fresh job), its figures or its failure
    added to ``report``."""
    try:
        report.resumes += resume_chain(
            folder, size, batch, launcher, timeout_s, running, rotate(methods, repeat), repeat
        )
    except SideFailed as exc:
        report.failures.append(f"resume {size:g} MB: {exc}")


def rotate(methods: Sequence[str], by: int) -> list[str]:
    shift = by % len(methods)
    return [*methods[shift:], *methods[:shift]]


def resume_chain(
    folder: Path,
    size: float,
    batch: int,
    launcher: str,
    timeout_s: float,
    running: Job | None,
    methods: Sequence[str],
    repeat: int,
) -> list[ResumeFigures]:
    """Kill ``running`` (or a fresh job that saved each method's checkpoint), resume by the first
    method, kill that after its first step, resume by the next, and so on."""
    base = trainer_params(size, batch)
    size_folder = folder / f"size-{size:g}"
    prepare = running is None
    if running is None:
        params = base | {"phase": "prepare", "resume_methods": list(RESUME_METHODS)}
        running = launch(f"prepare-{repeat}", size_folder, params, launcher)
    found = []
    try:
        if prepare:  # inside the try: a prepare job that fails is killed too
            running.wait_for(size_folder / "checkpoints" / "ready.json", timeout_s)
        for method in methods:
            resumed_file = size_folder / "checkpoints" / "resumed.json"
            resumed_file.unlink(missing_ok=True)
            killed = running.kill()
            params = base | {"phase": "resume", "method": method}
            running = launch(f"resume-{method}-{repeat}", size_folder, params, launcher)
            resumed = running.wait_for(resumed_file, timeout_s)
            if resumed["method"] != method:
                raise SideFailed(f"{resumed_file} is about {resumed['method']}, not {method}")
            found.append(
                ResumeFigures(size, method, killed, running.launched, resumed["times"], resumed["step"])
            )
    finally:
        running.kill()
    return found
