"""Exactly-once submission on the real local Slurm cluster: a lost sbatch reply, a crash between sbatch and
the submission record, and an earlier attempt's ended job under the same job name.

Every attempt in a job dir is sbatched under the same ``--job-name``; what tells this attempt's job from
an earlier one's is its ``--comment=tunepod:<submission id>``. Each test checks, with plain squeue, how
many jobs Slurm holds under the name for that test (ended ones included: MinJobAge keeps them for an
hour here).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from launcher_contract import finish, fixture_job, wait_until
from sshd import TARGET, require_sshd, ssh_options
from test_slurm_launcher import slurm_jobs_named

from tunepod.errors import TransientError
from tunepod.launch.base import JobState, Resources
from tunepod.launch.runner import (
    SSH_CONNECTION_FAILED,
    CommandRunner,
    LocalRunner,
    SshRunner,
    TransientCommandFailed,
)
from tunepod.launch.slurm import SlurmLauncher
from tunepod.launch.submission import read_submission, write_submission
from tunepod.spec.models import SlurmLauncherSpec

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

# A comma, spaces and quotes: squeue --name would split this name, so find must match it another way.
AWKWARD_NAME = "trial 7, 'lost reply'"


def spec_for(root: Path, transport: str) -> SlurmLauncherSpec:
    values: dict[str, object] = {
        "kind": "slurm",
        "root": str(root),
        "python": sys.executable,
        "poll_cache_s": 0.2,
    }
    if transport == "ssh":
        values |= {"ssh": TARGET, "ssh_options": ssh_options()}
    return SlurmLauncherSpec.model_validate(values)


def real_runner(transport: str) -> CommandRunner:
    return SshRunner(TARGET, ssh_options()) if transport == "ssh" else LocalRunner()


@pytest.fixture(params=["local", "ssh"])
def transport(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "ssh":
        require_sshd()
    yield request.param


class SbatchReplyLost:
    """The real runner, except that sbatch's reply never arrives.

    ``queued=True``: sbatch runs for real and queues the job, then the call fails the way an ssh
    connection dropped after the command ran does. ``queued=False``: the connection fails before
    sbatch runs, so nothing is queued. Thread safe.
    """

    def __init__(self, inner: CommandRunner, *, queued: bool) -> None:
        self.inner = inner
        self.queued = queued
        self.sbatch_calls = 0
        self._lock = threading.Lock()

    def run(
        self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        if argv[0] != "sbatch":
            return self.inner.run(argv, input=input, timeout_s=timeout_s)
        with self._lock:
            self.sbatch_calls += 1
        if self.queued:
            self.inner.run(argv, input=input, timeout_s=timeout_s)
        lost = "Connection to 127.0.0.1 closed by remote host."
        raise TransientCommandFailed(argv, SSH_CONNECTION_FAILED, lost)


class OrchestratorDied(BaseException):
    """The orchestrator's process ended (killed, its node lost) right after sbatch queued the job."""


class DiesAfterSbatch:
    """The real runner, except that the orchestrator dies as soon as sbatch has queued the job: only
    the intent written before sending is on disk. Stand-in: an exception no caller catches in place
    of the process dying, which a test cannot time between sbatch and the record."""

    def __init__(self, inner: CommandRunner) -> None:
        self.inner = inner

    def run(
        self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        done = self.inner.run(argv, input=input, timeout_s=timeout_s)
        if argv[0] == "sbatch":
            raise OrchestratorDied(f"killed after sbatch queued job {done.stdout.strip()}")
        return done


def test_double_submission_after_a_lost_sbatch_reply(transport: str, tmp_path: Path) -> None:
    """sbatch queued the job, but its reply was lost: submit must adopt that job, not queue another.

    Stand-in: a runner that runs the real sbatch (here, or over ssh) and then raises the transient
    failure an ssh drop raises, because an ssh connection dropping right after sbatch queued the job
    cannot be timed from a test.
    """
    runner = SbatchReplyLost(real_runner(transport), queued=True)
    launcher = SlurmLauncher(spec_for(tmp_path / "shared", transport), runner)
    # No release file: should the test fail half way, the job still ends on its own.
    job = dataclasses.replace(fixture_job(tmp_path / "job", "succeed.py"), name=AWKWARD_NAME)

    handle = launcher.submit(job)

    assert runner.sbatch_calls == 1
    assert slurm_jobs_named(AWKWARD_NAME, under=tmp_path) == [handle.job_id]
    record = read_submission(job.paths)
    assert record is not None and record.job_id == handle.job_id
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()


def test_crash_between_sbatch_and_record_finds_the_job_after_it_left_the_queue(tmp_path: Path) -> None:
    """The orchestrator died after sbatch queued the job and before it recorded the job id; the job then
    ran to its end. A restarted orchestrator must find that ended job (Slurm remembers it for
    MinJobAge) by its name and comment, and follow it to its real outcome."""
    launcher = SlurmLauncher(spec_for(tmp_path / "shared", "local"))
    job = fixture_job(tmp_path / "job", "succeed.py")
    submitted = launcher.submit(job)
    assert finish(submitted) is JobState.SUCCEEDED, submitted.logs()
    queue = subprocess.run(
        ["squeue", "-h", "-j", submitted.job_id], capture_output=True, text=True, check=True, timeout=30
    )
    assert queue.stdout.strip() == ""  # it left the queue: only the controller's memory still has it
    record = read_submission(job.paths)
    assert record is not None
    write_submission(job.paths, record.model_copy(update={"job_id": None, "submitted_at": None}))

    restarted = SlurmLauncher(launcher.spec)
    found = restarted.recorded(job.job_dir)

    assert found is not None and found.job_id == submitted.job_id
    assert found.state() is JobState.SUCCEEDED
    completed = read_submission(job.paths)
    assert completed is not None and completed.job_id == submitted.job_id
    assert slurm_jobs_named(job.name, under=tmp_path) == [submitted.job_id]


def test_new_attempt_never_adopts_the_ended_job_of_an_earlier_attempt(tmp_path: Path) -> None:
    """Attempt 1 failed and ended; attempt 2's sbatch never reached Slurm (the connection failed first).
    Attempt 1's job has the same job name, but not attempt 2's comment: submit must report the failure
    rather than hand back attempt 1's FAILED job as attempt 2, and the next submit queues attempt 2."""
    spec = spec_for(tmp_path / "shared", "local")
    job = fixture_job(tmp_path / "job", "fail.py", "attempt 1 failed")
    first = SlurmLauncher(spec).submit(job)
    assert finish(first) is JobState.FAILED

    retry = fixture_job(tmp_path / "job", "succeed.py")
    unreachable = SbatchReplyLost(LocalRunner(), queued=False)
    with pytest.raises(TransientError, match="closed by remote host"):
        SlurmLauncher(spec, unreachable).submit(retry)
    intent = read_submission(job.paths)
    assert intent is not None and intent.is_intent and intent.attempt == 2

    restarted = SlurmLauncher(spec)
    assert restarted.recorded(job.job_dir) is None
    second = restarted.submit(retry)

    assert second.job_id != first.job_id
    record = read_submission(job.paths)
    assert record is not None
    assert (record.attempt, record.submission_id, record.job_id) == (2, intent.submission_id, second.job_id)
    assert slurm_jobs_named(job.name, under=tmp_path) == [first.job_id, second.job_id]
    assert finish(second) is JobState.SUCCEEDED, second.logs()


@pytest.mark.parametrize("lost", ["reply", "record"])
def test_a_job_adopted_after_a_lost_sbatch_reply_keeps_its_stop_grace(lost: str, tmp_path: Path) -> None:
    """Real fault: sbatch queued a job with ``resources.stop_grace_s: 30`` whose script needs 12 s to
    save after SIGTERM, past the test cluster's KillWait of 10 s, and the orchestrator never heard the
    job id: the reply was lost and submit's look-up adopted the job (``reply``), or the orchestrator
    died before recording it and a restarted one resolved the intent on disk (``record``; stand-ins
    for both as above). Stopping the adopted job (a prune) must give its tasks SIGTERM and the grace,
    as for a job sent normally: the script saves and exits 0. A plain scancel SIGKILLs it mid-save."""
    spec = spec_for(tmp_path / "shared", "local")
    job = fixture_job(tmp_path / "graced", "slow_save.py", "12", resources=Resources(stop_grace_s=30))
    if lost == "reply":
        handle = SlurmLauncher(spec, SbatchReplyLost(LocalRunner(), queued=True)).submit(job)
    else:
        with pytest.raises(OrchestratorDied):
            SlurmLauncher(spec, DiesAfterSbatch(LocalRunner())).submit(job)
        found = SlurmLauncher(spec).recorded(job.job_dir)
        assert found is not None
        handle = found
    wait_until(lambda: (job.job_dir / "started").exists(), "the script to start")

    handle.cancel(reason="pruned")

    saved = job.job_dir / "saved"
    assert saved.exists(), f"killed mid-save: {handle.describe()}"
    times = json.loads(saved.read_text())
    assert times["saved_at"] - times["signal_at"] >= 12  # it outlived KillWait
    assert (handle.status().state, handle.status().exit_code) == ("COMPLETED", 0)
    assert slurm_jobs_named(job.name, under=tmp_path) == [handle.job_id]
