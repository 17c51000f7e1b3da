"""The two servers, each a uvicorn process of its own on a loopback port, started as a user starts them.

tunepod: ``python -m tunepod.webhook serve`` (what ``tunepod webhook serve`` and ``tunepod up`` run),
from the repository root so that the hook's spec path resolves, with ``PREFECT_API_URL`` naming the
Prefect server its events go to. baseline: ``python -m benchmarks.webhook.baseline``, the same
``uvicorn.run`` call around an app that does nothing.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
SECRET_ENV = "TUNEPOD_BENCH_HOOK_SECRET"
SPEC = "examples/digits/pipeline.yaml"
#: The load's hook and the race's hook: the race's events are counted apart from the load's.
LOAD_HOOK = "bench"
RACE_HOOK = "race"
#: High enough that the load never meets the rate limit (the receiver still takes a token per delivery).
RATE_LIMIT_PER_MIN = 10_000_000
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Server:
    side: str
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path
    secret: str = ""  # the hooks' secret (tunepod; the baseline checks none)

    def hook_url(self, hook: str) -> str:
        return f"{self.url}/hooks/{hook}"


def write_config(folder: Path) -> Path:
    """The receiver's hook file: the load's hook and the race's, one secret, the digits spec."""
    hook = {
        "spec": SPEC,
        "secrets": [{"env": SECRET_ENV}],
        "rate_limit_per_min": RATE_LIMIT_PER_MIN,
        "overrides": ["steps.search.with.num_trials={payload.num_trials}"],
    }
    path = folder / "webhooks.yaml"
    path.write_text(yaml.safe_dump({"hooks": {LOAD_HOOK: hook, RACE_HOOK: hook}}))
    return path


@contextmanager
def both(folder: Path, secret: str, api_url: str, timeout_s: float) -> Iterator[tuple[Server, Server]]:
    """The baseline and the receiver, started side by side (their imports overlap), stopped on exit."""
    with ExitStack() as stack:
        baseline = bare_endpoint(folder)
        stack.callback(stop, baseline.process)
        receiver = tunepod_receiver(folder, secret, api_url)
        stack.callback(stop, receiver.process)
        for server in (baseline, receiver):
            wait_until_listening(server, timeout_s)
        yield baseline, receiver


def tunepod_receiver(folder: Path, secret: str, api_url: str) -> Server:
    """``tunepod webhook serve`` with the benchmark's hooks, its dedupe log under ``folder/state``."""
    config = write_config(folder)
    port = free_port()
    argv = [sys.executable, "-m", "tunepod.webhook", "serve", "--config", str(config)]
    argv += ["--host", HOST, "--port", str(port), "--state-dir", str(folder / "state")]
    env = {**os.environ, SECRET_ENV: secret, "PREFECT_API_URL": api_url}
    return dataclasses.replace(launch("tunepod", argv, env, port, folder / "tunepod.log"), secret=secret)


def bare_endpoint(folder: Path) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.webhook.baseline", "--host", HOST, "--port", str(port)]
    return launch("baseline", argv, dict(os.environ), port, folder / "baseline.log")


def launch(side: str, argv: list[str], env: dict[str, str], port: int, log: Path) -> Server:
    """Start ``argv`` from the repository root, its output to ``log``."""
    with log.open("wb") as output:
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
    return Server(side, f"http://{HOST}:{port}", port, process, log)


def wait_until_listening(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.side} exited {server.process.returncode}:\n{tail(server.log)}")
        try:
            with socket.create_connection((HOST, server.port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(
        f"{server.side} did not listen on {server.url} in {timeout_s:.0f} s:\n{tail(server.log)}"
    )


def stop(process: subprocess.Popen[Any]) -> None:
    """SIGINT (uvicorn's graceful shutdown), then SIGKILL after ``STOP_TIMEOUT_S``."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_seconds(process: subprocess.Popen[Any]) -> float:
    """User + system CPU seconds ``process`` and its running children (the receiver's publisher
    process) have used so far, all their threads together (Linux /proc)."""
    return sum(_own_cpu_seconds(pid) for pid in [process.pid, *children(process.pid)])


def children(pid: int) -> list[int]:
    """The running child processes of ``pid`` (Linux /proc)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _own_cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:  # it ended meanwhile
        return 0.0
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5), counted from 1
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def tail(log: Path, lines: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
