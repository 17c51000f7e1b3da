"""Processes a local job leaves behind after its wrapper exited (defect 3 of the launcher review).

A torchrun worker outlives an agent that was killed (workers run in sessions of their own), and a
script may leave a child in a session of its own. Before the fix the launcher trusted the exit-code
file alone: the job was over while those processes trained on, and the driver started the next
attempt beside them in the same job dir. Every process here is real; each test kills whatever its
jobs left (found by an environment tag every process of its jobs inherits), even when it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from launcher_contract import JOB_TIMEOUT_S, finish, fixture_job, is_alive, recorded_pids, wait_until

from tunepod.errors import JobError
from tunepod.launch.base import JobSpec, JobState
from tunepod.launch.drive import DriveSettings, JobDriver, Outcome
from tunepod.launch.local import LocalJob, LocalLauncher
from tunepod.launch.local.processes import LinuxProcesses, submission_processes
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_submission

pytestmark = pytest.mark.timeout(180)

TAG_ENV = "TUNEPOD_TEST_LEFTOVERS"


@pytest.fixture
def tag() -> Iterator[str]:
    """A tag for this test's jobs (see ``tagged``); every process carrying it is killed at the end."""
    value = uuid.uuid4().hex
    yield value
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (pids := tagged_processes(value)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def tagged(job: JobSpec, tag: str) -> JobSpec:
    return job.with_env({TAG_ENV: tag})


def tagged_processes(tag: str) -> list[int]:
    needle = f"\0{TAG_ENV}={tag}\0".encode()
    found = []
    for pid, _ in LinuxProcesses().live():
        with contextlib.suppress(OSError):
            if needle in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                found.append(pid)
    return found


def straggler_job(job_dir: Path, record_dir: Path, exit_code: int, *mode: str) -> JobSpec:
    """``leave_straggler.py``: leaves ``_straggler.py`` (in ``mode``) running, then exits ``exit_code``."""
    return fixture_job(job_dir, "leave_straggler.py", str(record_dir), str(exit_code), *mode)


def is_torchrun_agent(pid: int) -> bool:
    """``python -m torch.distributed.run ...`` (the wrapper's argv names it too, further on)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"torch.distributed.run"]


def straggler(record_dir: Path) -> dict[str, object]:
    parsed: dict[str, object] = json.loads((record_dir / "straggler.json").read_text())
    return parsed


@pytest.mark.parametrize(("exit_code", "outcome"), [(3, JobState.FAILED), (0, JobState.SUCCEEDED)])
def test_a_job_is_not_over_while_a_process_it_left_in_its_own_session_lives(
    tmp_path: Path, tag: str, exit_code: int, outcome: JobState
) -> None:
    """The job exits (its wrapper records the code) while its straggler lives on: the job stays
    RUNNING and its job dir takes no new attempt; the launcher asks the straggler to stop (SIGTERM),
    and the recorded exit code becomes the outcome only once the straggler has gone."""
    launcher = LocalLauncher(tmp_path / "shared", cancel_grace_s=JOB_TIMEOUT_S)  # SIGTERM only, here
    records, release = tmp_path / "records", tmp_path / "release"
    job = tagged(straggler_job(tmp_path / "job", records, exit_code, "hold-on-sigterm", str(release)), tag)
    handle = launcher.submit(job)
    assert isinstance(handle, LocalJob)
    # The straggler holds on after SIGTERM until released: what is asserted below happens while it lives.
    wait_until(
        lambda: handle.state().is_terminal or (records / "sigterm").exists(),
        "the job to end, or the launcher to ask its leftover process to stop",
    )
    leftover = int(str(straggler(records)["pid"]))
    assert handle.exit_code == exit_code, "the job's own command has exited"
    assert is_alive(leftover)
    assert handle.state() is JobState.RUNNING, f"ended while its leftover lives: {handle.describe()}"
    assert handle.describe().endswith(f"exit code {exit_code}; stopping 1 leftover process")
    with pytest.raises(JobError, match="which has not ended"):
        launcher.submit(job)
    restarted = LocalLauncher(launcher.root, cancel_grace_s=JOB_TIMEOUT_S)  # another orchestrator
    assert restarted.attach(handle.job_id, job.job_dir).state() is JobState.RUNNING

    release.touch()
    assert finish(handle) is outcome
    assert not is_alive(leftover)
    assert handle.describe().endswith(f"exit code {exit_code}; 1 leftover process stopped")
    assert submission_processes(LinuxProcesses(), handle.submission_id) == []


def test_workers_that_outlive_a_killed_torchrun_agent_end_before_the_job_does(
    tmp_path: Path, tag: str
) -> None:
    """torchrun's agent is SIGKILLed (the OOM killer, a stray kill): its workers, in sessions of their
    own, train on, and the wrapper records 137. The job has not ended until they are gone."""
    launcher = LocalLauncher(tmp_path / "shared", cancel_grace_s=5.0)
    pid_dir = tmp_path / "pids"
    job = tagged(fixture_job(tmp_path / "job", "hang.py", str(pid_dir), procs=2), tag)
    handle = launcher.submit(job)
    assert isinstance(handle, LocalJob)
    wait_until(lambda: len(list(pid_dir.glob("rank-*.json"))) == 2, "both ranks to start")
    processes = submission_processes(LinuxProcesses(), handle.submission_id)
    (agent,) = [pid for pid, _ in processes if is_torchrun_agent(pid)]
    os.kill(agent, signal.SIGKILL)

    state = finish(handle)
    # Asked after the state: no process comes back to life, so any alive now lived when it was read.
    assert [pid for pid in recorded_pids(pid_dir) if is_alive(pid)] == [], f"{state}: {handle.describe()}"
    assert state is JobState.FAILED
    assert re.search(r"exit code 137; \d+ leftover processes stopped$", handle.describe()), handle.describe()
    assert submission_processes(LinuxProcesses(), handle.submission_id) == []


def test_a_restart_starts_only_once_the_failed_attempt_left_nothing_running(tmp_path: Path, tag: str) -> None:
    """The driver restarts a job that failed; its first attempt left a process that ignores SIGTERM.
    The second attempt must not start beside it (two writers of one job dir): the launcher kills the
    leftover (SIGKILL after the grace) before the first attempt counts as ended."""
    launcher = LocalLauncher(tmp_path / "shared", cancel_grace_s=0.5)
    records = tmp_path / "records"
    job = tagged(straggler_job(tmp_path / "job", records, 1, "ignore-sigterm"), tag)
    driver = JobDriver(launcher, job, DriveSettings(poll_s=0.05, max_restarts=1), what="leftover job")

    result = driver.run()

    first = straggler(records)
    record = read_submission(JobPaths(job.job_dir))
    assert record is not None and record.attempt == 2, "the failed attempt was not restarted"
    second = json.loads((records / "next-attempt.json").read_text())
    assert second["straggler_alive"] is False, "the second attempt started beside the first's leftover"
    assert result.outcome is Outcome.COMPLETED, result.message
    assert not is_alive(int(str(first["pid"])))
    for submission_id in (str(first["submission_id"]), record.submission_id):
        assert submission_processes(LinuxProcesses(), submission_id) == []
    assert first["submission_id"] != record.submission_id
