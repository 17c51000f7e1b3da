"""Running the simulation on one mutant: a fresh mutated copy of ``tunepod/``, seeds until the first
violation, within a time limit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from mutation.apply import REPO_ROOT, mutated_copy, package_origin, simulation_env
from mutation.catalog import Mutant

Status = Literal["found", "survived", "timed_out", "error"]

_VIOLATION = re.compile(r"^seed (\d+): (.*)$", re.MULTILINE)
_FINISHED = re.compile(r"^seeds: (\d+), violations: (\d+)", re.MULTILINE)
_PROGRESS = re.compile(r"^\.\.\. (\d+) seeds", re.MULTILINE)
_ERROR_TAIL_LINES = 15


@dataclass(frozen=True)
class Seeds:
    """Which seeds a mutant gets, on how many processes, within how long."""

    count: int
    first: int = 0
    jobs: int = 2
    time_limit_s: float = 900.0


@dataclass(frozen=True)
class Verdict:
    """What the simulation made of one mutant."""

    name: str
    path: str
    status: Status
    seconds: float
    seeds_run: int
    """Seeds that finished (for a found mutant: those reported up to the violating one; for one stopped
    at the time limit, at least this many: the simulation reports its progress every 250 seeds)."""
    seed: int | None = None
    """The violating seed that found it."""
    violation: str | None = None
    detail: str | None = None
    """For an error: the end of the simulation's output."""
    escapes: str | None = None

    @property
    def survived(self) -> bool:
        return self.status in ("survived", "timed_out")


@dataclass(frozen=True)
class _Run:
    output: str
    returncode: int | None
    """None when the run was stopped at its time limit."""


def hunt(mutant: Mutant, seeds: Seeds, python: str = sys.executable) -> Verdict:
    """Run the simulation on a copy of ``tunepod/`` with ``mutant`` applied (``StaleCatalog`` first,
    when its edit no longer applies)."""
    with tempfile.TemporaryDirectory(prefix=f"tunepod-mutant-{mutant.name}-") as folder:
        copy = mutated_copy(mutant, Path(folder))
        env = simulation_env(copy)
        _check_resolves_to(copy, env, python)
        started = time.monotonic()
        run = _simulate(env, seeds, python)
        took = time.monotonic() - started
    return judge(mutant, run.output, run.returncode, took)


def judge(mutant: Mutant, output: str, returncode: int | None, seconds: float) -> Verdict:
    """The verdict on ``mutant`` from the simulation's output and exit status (None: stopped at the
    time limit)."""
    verdict = Verdict(mutant.name, mutant.path, "error", seconds, _seeds_run(output), escapes=mutant.escapes)
    found = _VIOLATION.search(output)
    if found is not None:
        return replace(verdict, status="found", seed=int(found[1]), violation=found[2])
    if returncode is None:
        return replace(verdict, status="timed_out")
    if returncode == 0 and _FINISHED.search(output):
        return replace(verdict, status="survived")
    tail = "\n".join(output.rstrip().splitlines()[-_ERROR_TAIL_LINES:])
    return replace(verdict, detail=f"the simulation exited {returncode} without a violating seed:\n{tail}")


def _seeds_run(output: str) -> int:
    finished = _FINISHED.search(output)
    if finished is not None:
        return int(finished[1])
    progress = _PROGRESS.findall(output)
    return int(progress[-1]) if progress else 0


def _check_resolves_to(copy: Path, env: dict[str, str], python: str) -> None:
    """Refuse to run unless ``import tunepod`` finds the mutated copy: a run on the repository's own
    files would report every mutant as a survivor."""
    origin = package_origin(env, python)
    if not origin.is_relative_to(copy):
        raise RuntimeError(f"the simulation would import tunepod from {origin}, not the mutated copy {copy}")


def _simulate(env: dict[str, str], seeds: Seeds, python: str) -> _Run:
    """The simulation's many-seeds mode, stopping at the first violation, from the repository root
    (``-P``: that root, where the unmutated ``tunepod/`` is, stays off the path)."""
    command = [
        *(python, "-P", "-m", "simulation", "--stop-at-first"),
        *("--seeds", str(seeds.count), "--first-seed", str(seeds.first), "--jobs", str(seeds.jobs)),
    ]
    process = subprocess.Popen(
        command,
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the time limit ends its workers with it
    )
    try:
        output, _ = process.communicate(timeout=seeds.time_limit_s)
        return _Run(output, process.returncode)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return _Run(output, None)
