"""The sides of the staging benchmark: each one a command that stages the data set into a fresh folder
(full copy), then the command it re-runs on that folder when nothing changed (re-stage).

Every side runs as a process of its own, started afresh for each run. A baseline is timed from its
start to its exit. tunepod's child Python calls ``tunepod.staging.stage`` (what a pipeline's stage step
calls, in a worker that has tunepod imported already) and prints the ``StageReport``: its ``seconds``,
the call from its start (client, listing, every download, the manifest) to its return, are tunepod's
time; the child's start-to-exit time (interpreter start and imports added) is shown beside it.
"""

from __future__ import annotations

import filecmp
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.staging.dataset import BUCKET, PREFIX

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
TUNEPOD = "tunepod"
#: tunepod's own bookkeeping in a staged folder: not part of the data.
BOOKKEEPING = (".tunepod-manifest.json", ".tunepod-manifest.lock", ".tunepod-manifest.progress")

Command = Callable[[Path], list[str]]


@dataclass(frozen=True)
class Side:
    """One way of staging: ``full(target)`` into a fresh folder, ``restage(target)`` over it again."""

    name: str
    what: str
    full: Command
    restage: Command

    @property
    def is_tunepod(self) -> bool:
        return self.name == TUNEPOD


@dataclass
class Figures:
    """A side's timings over the repeats (seconds; tunepod's: in the call), the CPU seconds of its full
    copies (its own processes', the S3 server's), tunepod's process times, and any failure."""

    full: list[float] = field(default_factory=list)
    restage: list[float] = field(default_factory=list)
    cpu_full: list[float] = field(default_factory=list)
    server_cpu_full: list[float] = field(default_factory=list)
    process_full: list[float] = field(default_factory=list)
    process_restage: list[float] = field(default_factory=list)
    restage_copied: list[int] = field(default_factory=list)
    identical: bool | None = None
    error: str | None = None


def tunepod_command(source: str) -> Command:
    return lambda target: [sys.executable, "-m", "benchmarks.staging.tunepod_side", source, str(target)]


def s3_sides(endpoint_url: str) -> list[Side]:
    """aws s3 sync, s5cmd (cp, then sync for the re-stage: cp copies everything again) and tunepod."""
    uri = f"s3://{BUCKET}/{PREFIX}"
    aws = [str(VENV_BIN / "aws"), "s3", "sync", "--only-show-errors", "--endpoint-url", endpoint_url, uri]
    s5cmd = [str(VENV_BIN / "s5cmd"), "--log", "error", "--endpoint-url", endpoint_url]
    sides = [
        Side("aws", "aws s3 sync", lambda t: [*aws, str(t)], lambda t: [*aws, str(t)]),
        Side(
            "s5cmd",
            "s5cmd cp (re-stage: s5cmd sync)",
            lambda t: [*s5cmd, "cp", f"{uri}*", f"{t}/"],
            lambda t: [*s5cmd, "sync", f"{uri}*", f"{t}/"],
        ),
        Side(TUNEPOD, "tunepod.staging.stage (stage_s3)", tunepod_command(uri), tunepod_command(uri)),
    ]
    return [side for side in sides if side.is_tunepod or Path(side.full(Path("x"))[0]).exists()]


def folder_sides(source: Path, with_fsync: bool) -> list[Side]:
    """cp -r (re-stage: cp -ru, the only skip cp has), rsync -a, rsync -a --fsync (durable per file, as
    tunepod is) and tunepod."""
    rsync = ["rsync", "-a", f"{source}/"]
    rsync_fsync = ["rsync", "-a", "--fsync", f"{source}/"]
    sides = [
        Side("cp", "cp -r (re-stage: cp -ru)", lambda t: ["cp", "-r", f"{source}/.", str(t)],
             lambda t: ["cp", "-ru", f"{source}/.", str(t)]),
        Side("rsync", "rsync -a", lambda t: [*rsync, f"{t}/"], lambda t: [*rsync, f"{t}/"]),
        Side("rsync-fsync", "rsync -a --fsync", lambda t: [*rsync_fsync, f"{t}/"],
             lambda t: [*rsync_fsync, f"{t}/"]),
        Side(TUNEPOD, "tunepod.staging.stage (stage_folder)", tunepod_command(str(source)),
             tunepod_command(str(source))),
    ]  # fmt: skip
    return [
        side
        for side in sides
        if side.is_tunepod
        or (shutil.which(side.full(Path("x"))[0]) and (with_fsync or side.name != "rsync-fsync"))
    ]


def rsync_has_fsync() -> bool:
    """Whether an installed rsync has --fsync (3.2.4 and later); False without rsync."""
    if shutil.which("rsync") is None:
        return False
    done = subprocess.run(["rsync", "--help"], capture_output=True, text=True, check=False)
    return "--fsync" in done.stdout


@dataclass(frozen=True)
class Settings:
    """How the sides run: their environment, how many times, each command's bound, whether the last
    repeat's copies stay, whether re-stages run, and the S3 server's pid (to take its CPU time)."""

    env: dict[str, str]
    repeats: int
    timeout_s: float
    keep: bool = False
    restage: bool = True
    server_pid: int | None = None


def measure(sides: Sequence[Side], source: Path, work: Path, settings: Settings) -> dict[str, Figures]:
    """Every side ``settings.repeats`` times, the order rotated each time: a full copy into a fresh
    folder, then a re-stage over it. The first repeat's copies are compared byte by byte with
    ``source``. With ``keep``, the last repeat's folders stay in ``work`` (``<side>-<repeat>``)."""
    figures = {side.name: Figures() for side in sides}
    work.mkdir(parents=True, exist_ok=True)
    for repeat in range(settings.repeats):
        order = list(sides[repeat % len(sides) :]) + list(sides[: repeat % len(sides)])
        for side in order:
            found = figures[side.name]
            if found.error is not None:
                continue
            target = work / f"{side.name}-{repeat}"
            try:
                run_side(side, target, settings, found)
                if repeat == 0:
                    found.identical = same_tree(source, target)
            except SideFailed as exc:
                found.error = str(exc)
            if not (settings.keep and repeat == settings.repeats - 1):
                shutil.rmtree(target, ignore_errors=True)
    return figures


class SideFailed(Exception):
    pass


def run_side(side: Side, target: Path, settings: Settings, found: Figures) -> None:
    shutil.rmtree(target, ignore_errors=True)
    run = timed(side.full(target), settings)
    found.cpu_full.append(run.cpu_s)
    if run.server_cpu_s is not None:
        found.server_cpu_full.append(run.server_cpu_s)
    if side.is_tunepod:
        found.process_full.append(run.seconds)
    found.full.append(json.loads(run.stdout)["seconds"] if side.is_tunepod else run.seconds)
    if not settings.restage:
        return
    run = timed(side.restage(target), settings)
    if side.is_tunepod:
        found.process_restage.append(run.seconds)
        report = json.loads(run.stdout)
        found.restage_copied.append(report["copied_files"])
    found.restage.append(json.loads(run.stdout)["seconds"] if side.is_tunepod else run.seconds)


@dataclass(frozen=True)
class Run:
    seconds: float
    cpu_s: float
    server_cpu_s: float | None
    stdout: str


def timed(argv: list[str], settings: Settings) -> Run:
    """``argv`` run to its exit: its wall seconds, the CPU seconds of its processes (user + system),
    the S3 server's CPU seconds meanwhile, and its stdout. Dirty pages an earlier command left are
    written out first (not timed), so no side pays for another's writeback."""
    os.sync()
    server_before = cpu_seconds_of(settings.server_pid)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv, cwd=REPO, env=settings.env, capture_output=True, text=True, timeout=settings.timeout_s,
            check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise SideFailed(f"{' '.join(argv)} ran past {settings.timeout_s:.0f} s") from exc
    seconds = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_after = cpu_seconds_of(settings.server_pid)
    if done.returncode != 0:
        raise SideFailed(f"{' '.join(argv)} exited {done.returncode}: {(done.stderr or done.stdout)[-800:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    server = None if server_after is None or server_before is None else server_after - server_before
    return Run(seconds, cpu, server, done.stdout)


def cpu_seconds_of(pid: int | None) -> float | None:
    """User + system CPU seconds of the running process ``pid`` so far (from /proc); ``None`` if unknown."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def data_files(root: Path) -> list[str]:
    """The relative paths of the data files under ``root`` (tunepod's bookkeeping left out)."""
    return sorted(
        path.relative_to(root).as_posix()
        for path in root.rglob("*")
        if path.is_file() and path.name not in BOOKKEEPING
    )


def same_tree(expected: Path, found: Path) -> bool:
    """Whether ``found`` holds exactly the files of ``expected``, byte for byte."""
    names = data_files(expected)
    if data_files(found) != names:
        return False
    _, mismatch, errors = filecmp.cmpfiles(expected, found, names, shallow=False)
    return not mismatch and not errors
