"""Long-lived background processes started by ``tunepod up``, found again by later commands.

A started service is recorded in ``<home>/stack/<name>.json``: its pid, the start time of that pid
(so a later process that reuses the pid is never mistaken for ours), its process group, its URL and
its log file. ``tunepod status`` and ``tunepod down`` read these records; nothing else is shared
between the commands, which are separate processes.

Each service is started as the leader of a new session, so its process group holds the children it
starts (uvicorn, gunicorn workers) and ``stop`` signals the whole group. Children that start sessions of
their own (Prefect's flow-run processes, torchrun workers) are outside the group on purpose: a flow run
in flight is not the stack's to kill.

Linux only (``/proc``). Not thread-safe: one ``tunepod`` command at a time per home folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tunepod.launch.local import read_process_stat
from tunepod.runtime.files import write_bytes_atomic

_POLL_S = 0.1


@dataclass(frozen=True)
class ServiceRecord:
    """What ``start_service`` writes about one running service; ``up`` owns the file, ``down`` removes it."""

    name: str
    pid: int
    """Leader of the service's session and process group (pgid == pid)."""
    start_ticks: int
    """Field 22 of ``/proc/<pid>/stat`` at start: with the pid, it identifies this one process."""
    url: str
    health_url: str
    """Empty for a service whose health is asked of another (the worker, through Prefect's API)."""
    log: str
    argv: list[str]

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2).encode() + b"\n"

    @classmethod
    def read(cls, path: Path) -> ServiceRecord | None:
        """The record at ``path``, or None when there is none (or it is unreadable: a crash mid-write)."""
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def is_alive(record: ServiceRecord) -> bool:
    """Whether the recorded process still runs: same pid, same start time, and not a zombie."""
    stat = read_process_stat(record.pid)
    return stat is not None and stat.start_ticks == record.start_ticks and not stat.is_dead


@dataclass(frozen=True)
class Service:
    """How to start one service, and what to record about it."""

    name: str
    argv: list[str]
    env: dict[str, str]
    url: str
    """What to print for the user (a UI or an endpoint)."""
    health_url: str
    """``GET`` answers 2xx when healthy; empty for the worker, which is asked about through the API."""


def start_service(service: Service, log: Path, cwd: Path, record_path: Path) -> ServiceRecord:
    """Start ``argv`` detached (own session, output appended to ``log``) and record it at ``record_path``.

    The caller checks health afterwards; this returns as soon as the process exists.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        now = time.strftime("%Y-%m-%dT%H:%M:%S")
        banner = f"\n==> {now} starting {service.name}: {' '.join(service.argv)}\n"
        out.write(banner.encode())
        out.flush()
        process = subprocess.Popen(
            service.argv,
            cwd=cwd,
            env=service.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    stat = read_process_stat(process.pid)
    # A process that died within microseconds has no stat; record 0 so is_alive says dead.
    start_ticks = stat.start_ticks if stat is not None else 0
    record = ServiceRecord(
        service.name, process.pid, start_ticks, service.url, service.health_url, str(log), service.argv
    )
    write_bytes_atomic(record_path, record.to_json())
    return record


def group_members(pgid: int) -> list[int]:
    """The live (non-zombie) processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = read_process_stat(int(entry.name))
        if stat is not None and stat.pgid == pgid and not stat.is_dead:
            members.append(int(entry.name))
    return members


def stop_service(record: ServiceRecord, grace_s: float = 10.0) -> bool:
    """SIGTERM the service's process group, SIGKILL what is left after ``grace_s``; wait until it is gone.

    Returns False when the recorded process was already gone (a later process with the same pid is left
    alone). Processes of the group that outlive SIGKILL by 10 s raise ``TimeoutError`` with their pids.
    """
    if not is_alive(record):
        # The leader is gone; its group may still hold children, but only while no one reused the
        # pgid, which the kernel forbids while any member lives: signalling them is safe.
        leftovers = group_members(record.pid)
        if not leftovers:
            return False
    signal_group(record.pid, signal.SIGTERM)
    if not _wait_group_gone(record, grace_s):
        signal_group(record.pid, signal.SIGKILL)
        if not _wait_group_gone(record, 10.0):
            raise TimeoutError(
                f"{record.name}: processes {group_members(record.pid)} of group {record.pid} survive SIGKILL"
            )
    return True


def signal_group(pgid: int, signum: signal.Signals) -> None:
    """Send ``signum`` to process group ``pgid``; nothing when the group is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)


def _wait_group_gone(record: ServiceRecord, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        _reap(record.pid)
        if not is_alive(record) and not group_members(record.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)


def _reap(pid: int) -> None:
    # When this process started the service (tests call up and down in one process) the leader is our
    # child: collect it so it does not linger as our zombie.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
