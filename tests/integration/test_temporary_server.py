"""``tunepod run`` with no Prefect server set and no local stack: it starts a Prefect server of its own
for the run (``tunepod.stack.temporary``), the way a user running ``make demo`` on a fresh machine meets
it. Each test gets a Prefect home of its own, so its server starts on a new SQLite database.

Proves: the run completes on that server and leaves no server behind; a server that cannot start is
reported with its log and the run exits 1; a run SIGKILLed mid-way (the real fault) takes its server
down with it through the kernel's parent-death signal.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_study import write_tiny_study

from tunepod.launch.procfs import read_process_stat

REPO = Path(__file__).resolve().parents[2]
SERVER_LINE = re.compile(r"Prefect: a temporary server for this run, http://127\.0\.0\.1:(\d+)/api")


def run_env(tmp_path: Path, **changes: str) -> dict[str, str]:
    """No Prefect server set, no runner, a Prefect home of the test's own."""
    env = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}
    return {**env, "PREFECT_HOME": str(tmp_path / "prefect"), "TUNEPOD_RUNNER": "off", **changes}


def tunepod_run(spec: Path, tmp_path: Path) -> list[str]:
    return [sys.executable, "-m", "tunepod.cli", "run", str(spec), "--home", str(tmp_path / "no-stack")]


def servers_on(port: str) -> list[int]:
    """The processes whose command line is a Prefect server on ``port`` (live ones, not zombies)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        stat = read_process_stat(int(entry.name))
        if b"server" in argv and port.encode() in argv and stat is not None and not stat.is_dead:
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_a_run_without_a_server_starts_one_runs_on_it_and_stops_it(tmp_path: Path) -> None:
    spec, _, _ = write_tiny_study(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", num_trials=1, epochs=1)
    done = subprocess.run(
        tunepod_run(spec, tmp_path), cwd=REPO, env=run_env(tmp_path), capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    port = SERVER_LINE.search(done.stderr)
    assert port is not None, output
    assert servers_on(port[1]) == [], "the temporary server outlived its run"
    assert "View at" not in output  # no UI on the temporary server: no link that leads nowhere
    # The run is in the Prefect home's database, as Prefect's own temporary server keeps it.
    with sqlite3.connect(tmp_path / "prefect" / "prefect.db") as db:
        states = db.execute("SELECT state_type FROM flow_run WHERE name = ?", (str(spec),)).fetchall()
    assert states == [("COMPLETED",)]


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    spec, _, _ = write_tiny_study(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", num_trials=1, epochs=1)
    # A database in a folder that does not exist: the server's migrations fail and it exits.
    env = run_env(
        tmp_path, PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp_path}/missing/dir/prefect.db"
    )
    done = subprocess.run(
        tunepod_run(spec, tmp_path), cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the temporary Prefect server for this run exited with" in done.stderr, done.stderr
    assert "fix: start one that stays up with `tunepod up`" in done.stderr
    log = re.search(r"its log, (\S+), ends with", done.stderr)
    assert log is not None and Path(log[1]).exists(), done.stderr  # kept for the reader
    assert not list((tmp_path / "shared").glob("jobs/*/*")), "no trial may start without a server"


@pytest.mark.slow
def test_a_killed_run_takes_its_server_down(tmp_path: Path) -> None:
    """Fault: SIGKILL of `tunepod run` alone (not its process group, as the OOM killer would), once its
    flow runs on the server. The server, in a session of its own, gets the parent-death signal and
    stops. (The trial's job, if it started, ends on its own two 1-s epochs later.)"""
    spec, _, _ = write_tiny_study(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", num_trials=1, epochs=2)
    log = tmp_path / "run.log"
    with log.open("wb") as out:
        run = subprocess.Popen(
            tunepod_run(spec, tmp_path), cwd=REPO, env=run_env(tmp_path), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 240
        while "Beginning flow run" not in log.read_text():
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.1)
        port = SERVER_LINE.search(log.read_text())
        assert port is not None, log.read_text()
        assert servers_on(port[1]), "no server process found while the run runs"
        run.send_signal(signal.SIGKILL)
        run.wait(10)
        deadline = time.monotonic() + 30
        while servers_on(port[1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert servers_on(port[1]) == [], f"the server outlived its killed run:\n{log.read_text()[-4000:]}"
    finally:
        run.kill()
        run.wait(10)
