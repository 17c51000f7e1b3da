"""Run one arm's study for one seed, watch it for the target, and read its time to target back.

The study runs as a child process (``benchmarks.quality.driver``, or ``tunepod run`` with ``--driver
cli``). Every process it starts, jobs included, inherits ``MARKER_ENV``: the local launcher starts jobs
in sessions of their own, so a process group does not hold them, but the environment does. When the
target is reached the rest of the study cannot change the time to target (it is already in the past),
so by default the study is stopped there: the child first, then every process carrying its marker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.quality.timing import (
    Hit,
    best_value,
    first_hit,
    study_span,
    trial_reports,
    trials_started_by,
)
from benchmarks.quality.workloads import REPO, Workload

MARKER_ENV = "QUALITY_BENCH_STUDY"
POLL_S = 0.25
LOG_TAIL_LINES = 40


class StudyFailed(Exception):
    """A study's process exited non-zero before its target; the message holds its log's tail."""


@dataclass
class StudyRun:
    """One study's outcome, read from its files."""

    workload: str
    arm: str
    seed: int
    folder: Path
    """Where the study's trials left their job dirs."""
    start: float
    """The study's start, seconds since the epoch (its first trial's creation)."""
    hit: Hit | None
    end: float | None
    """The study's end (its last trial's completion); None when it was stopped at its target."""
    trials_started: int
    """Trials the study had started by its hit, or in all when it missed."""
    pruned: int
    best: float
    warnings: list[str] = field(default_factory=list)

    @property
    def reached(self) -> bool:
        return self.hit is not None

    @property
    def time_s(self) -> float:
        """Seconds from the start to the first report that reached the target; for a study that never
        did, to its end (censored: the target would have come later, if at all)."""
        if self.hit is not None:
            return self.hit.time - self.start
        assert self.end is not None  # a study that missed ran to its end
        return self.end - self.start


def tunepod_argv(workload: Workload, overrides: list[str], driver: str) -> list[str]:
    spec = str(workload.spec.relative_to(REPO))
    if driver == "library":
        return [sys.executable, "-m", "benchmarks.quality.driver", spec, *overrides]
    entry_point = Path(sys.executable).with_name("tunepod")
    command = [str(entry_point)] if entry_point.exists() else [sys.executable, "-m", "tunepod.cli"]
    return [*command, "run", spec, *(arg for o in overrides for arg in ("--set", o))]


def run_study(
    workload: Workload,
    arm: str,
    seed: int,
    root: Path,
    *,
    driver: str = "library",
    stop_at_target: bool = True,
    prefect_api: str | None = None,
    abort: threading.Event | None = None,
) -> StudyRun:
    """One tunepod study of ``arm`` with ``seed``, its stores under ``root`` (see Workload.overrides)."""
    argv = tunepod_argv(workload, workload.overrides(arm, seed, root), driver)
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    name = workload.study_name(arm, seed)
    jobs_dir = workload.jobs_dir(root, arm, seed)

    def reached() -> bool:
        return first_hit(trial_reports(jobs_dir), workload.goal) is not None

    stopped = watch_child(argv, env, root / f"{name}.log", reached, stop_at_target, abort)
    span = study_span(workload.storage(root, arm, seed), name)
    reports = trial_reports(jobs_dir)
    hit = first_hit(reports, workload.goal)
    if hit is None and (stopped or span.end is None):
        raise StudyFailed(f"{arm} seed {seed}: stopped without a hit; see {jobs_dir}")
    starts = span.trial_starts.values()
    return StudyRun(
        workload=workload.name,
        arm=arm,
        seed=seed,
        folder=jobs_dir,
        start=span.start,
        hit=hit,
        end=None if stopped else span.end,
        trials_started=trials_started_by(starts, hit.time) if hit else len(starts),
        pruned=span.pruned,
        best=best_value(reports, workload.goal),
    )


def watch_child(
    argv: list[str],
    env: dict[str, str],
    log: Path,
    done: Callable[[], bool],
    stop_when_done: bool,
    abort: threading.Event | None = None,
) -> bool:
    """Run ``argv`` (output into ``log``) to its end, or stop it once ``done()`` holds and
    ``stop_when_done``; return whether it was stopped. ``StudyFailed`` when it exits non-zero or
    ``abort`` is set (a study beside it failed)."""
    marker = str(log)
    with open(log, "wb") as out:
        child = subprocess.Popen(
            argv, cwd=REPO, env={**env, MARKER_ENV: marker}, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            while child.poll() is None:
                if stop_when_done and done():
                    stop_marked(child, marker)
                    return True
                if abort is not None and abort.is_set():
                    stop_marked(child, marker)
                    raise StudyFailed(f"{' '.join(argv[:4])} ... stopped: a study beside it failed")
                time.sleep(POLL_S)
        except BaseException:
            stop_marked(child, marker)
            raise
    if child.returncode != 0:
        raise StudyFailed(f"{' '.join(argv[:4])} ... exited {child.returncode}; log {log}:\n{tail(log)}")
    return False


def stop_marked(child: subprocess.Popen[bytes], marker: str) -> None:
    """SIGKILL ``child`` (so that it starts nothing more), then every process carrying ``marker``."""
    child.kill()
    child.wait()
    for _ in range(10):  # a job's process may start a child of its own while the sweep runs
        pids = marked_processes(marker)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def marked_processes(marker: str) -> list[int]:
    """Live processes whose environment holds ``MARKER_ENV=marker`` (this one excluded)."""
    from tunepod.launch.local.processes import live_processes

    needle = f"\0{MARKER_ENV}={marker}\0".encode()
    found = []
    for pid, _ in live_processes():
        if pid == os.getpid():
            continue
        try:
            environ = b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if needle in environ:
            found.append(pid)
    return found


def tail(path: Path) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
