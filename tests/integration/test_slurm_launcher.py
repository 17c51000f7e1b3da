"""The launcher contract against ``SlurmLauncher`` on the real local Slurm cluster (``scripts/slurm-up``),
plus Slurm-only tests: awkward paths through sbatch, one squeue call for many handles, the state line
in a failed job's logs, purged job ids, and resubmission into a used job dir. Lost sbatch replies and
crashes between sbatch and the record are in ``test_slurm_exactly_once.py``.

Jobs run on this host as the submitting user, so ``tmp_path`` serves as the shared filesystem.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
from launcher_contract import JOBS, LauncherContract, finish, fixture_job, wait_until
from tiny_study import as_submitted, preview_first_trial

from tunepod.errors import JobError
from tunepod.launch.base import JobHandle, JobSpec, JobState, Launcher, Resources
from tunepod.launch.paths import JobPaths
from tunepod.launch.runner import LocalRunner
from tunepod.launch.slurm import SCRIPT_NAME, SlurmLauncher
from tunepod.launch.slurm.launcher import recorded_status
from tunepod.launch.status_cache import TrackedJob
from tunepod.launch.submission import read_submission
from tunepod.spec.models import SlurmLauncherSpec

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

# The largest job id Slurm hands out (MaxJobId's ceiling): no test cluster gets there.
UNKNOWN_JOB_ID = "67108863"


def slurm_spec(root: Path, **fields: object) -> SlurmLauncherSpec:
    # The repo's venv python on the "compute node" (this host); a short cache keeps the tests brisk.
    values = {"kind": "slurm", "root": str(root), "python": sys.executable, "poll_cache_s": 0.2, **fields}
    return SlurmLauncherSpec.model_validate(values)


@pytest.fixture
def slurm_launcher(tmp_path: Path) -> SlurmLauncher:
    return SlurmLauncher(slurm_spec(tmp_path / "shared"))


class SlurmContract(LauncherContract):
    """How Slurm restarts and crashes a job, for every Slurm launcher (local commands or over ssh)."""

    def restart(self, launcher: Launcher) -> Launcher:
        assert isinstance(launcher, SlurmLauncher)
        return SlurmLauncher(launcher.spec)

    def kill_hard(self, handle: JobHandle) -> None:
        # What Slurm does to a job on a failed node: kill it and put it back in the queue.
        subprocess.run(["scontrol", "requeue", handle.job_id], check=True, capture_output=True, timeout=30)

    def resume_after_crash(self, launcher: Launcher, job: JobSpec, crashed: JobHandle) -> JobHandle:
        # Slurm requeued the job by itself (--requeue): the same job id runs again in the same job dir.
        return crashed

    def jobs_named(self, launcher: Launcher, name: str) -> list[str]:
        assert isinstance(launcher, SlurmLauncher)
        # Every contract test writes its job dirs beside the launcher's root, in the test's tmp_path.
        return slurm_jobs_named(name, under=Path(launcher.spec.root).parent)


def slurm_jobs_named(name: str, *, under: Path) -> list[str]:
    """The ids of every job the controller knows under the job name ``name`` whose logs go below
    ``under``: queued, running, and ended ones it still remembers (MinJobAge is an hour on the test
    cluster, which runs no accounting).

    ``under`` scopes the answer to one test: the cluster is shared, and every contract test names its
    job after its job dir (``job``). Asked with plain squeue on this host, not through the launcher under
    test (the ssh tests' head node is this host too). The name is matched here, exactly, because
    ``--name`` splits at commas; it is the last field because it may hold ``|``.
    """
    listing = subprocess.run(
        ["squeue", "-h", "--states=all", "-O", "JobID:|,StdOut:|,Name:"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    rows = (line.split("|", 2) for line in listing.splitlines() if line.count("|") >= 2)
    prefix = f"{under}/"
    found = [job_id for job_id, stdout, job_name in rows if job_name == name and stdout.startswith(prefix)]
    return sorted(found, key=int)


class TestSlurmLauncherContract(SlurmContract):
    @pytest.fixture
    def launcher(self, slurm_launcher: SlurmLauncher) -> Launcher:
        return slurm_launcher


class CountingRunner:
    """The real ``LocalRunner``, counting the commands it runs by program name (thread safe)."""

    def __init__(self) -> None:
        self.inner = LocalRunner()
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def run(
        self, argv: Sequence[str], *, input: str | None = None, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        with self._lock:
            self.calls[argv[0]] += 1
        return self.inner.run(argv, input=input, timeout_s=timeout_s)


def test_slurm_launcher_implements_the_protocol(slurm_launcher: SlurmLauncher) -> None:
    assert isinstance(slurm_launcher, Launcher)
    assert slurm_launcher.kind == "slurm"


def test_paths_names_and_args_with_spaces_and_quotes_run_for_real(
    slurm_launcher: SlurmLauncher, tmp_path: Path
) -> None:
    weird = tmp_path / 'it\'s a "quoted" $HOME #dir %j'
    weird.mkdir()
    script = weird / "echo 'args' $1.py"
    shutil.copy(JOBS / "echo_args.py", script)
    out = weird / "out %j.json"
    args = ("$HOME", "a  b", "it's", '"q"', "`id`", "*", "$(true)", "%j", "")
    job = dataclasses.replace(
        fixture_job(weird / "job dir", "echo_args.py", str(out), *args),
        name="trial 'seven' \"q\"",
        entrypoint=script,
    )
    handle = slurm_launcher.submit(job)
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()
    assert json.loads(out.read_text()) == list(args)
    # The logs landed at the literal paths: sbatch expanded no %j and split nothing at a space.
    assert sorted(p.name for p in job.job_dir.iterdir() if p.suffix == ".log") == ["stderr.log", "stdout.log"]
    assert (job.job_dir / SCRIPT_NAME).exists()
    record = read_submission(job.paths)
    assert record is not None and record.job_id == handle.job_id
    assert record.name == job.name
    assert slurm_jobs_named(job.name, under=tmp_path) == [handle.job_id]


def test_one_squeue_call_serves_every_handle(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tunepod.launch.base")  # the template warns once
    runner = CountingRunner()
    launcher = SlurmLauncher(slurm_spec(tmp_path / "shared", poll_cache_s=3600), runner)
    release = tmp_path / "release"
    ignored = Resources(instance_type="ml.g5.xlarge")
    handles = [
        launcher.submit(fixture_job(tmp_path / f"job{i}", "succeed.py", str(release), resources=ignored))
        for i in range(3)
    ]
    # Fresh job dirs: submitting asks Slurm nothing but sbatch, and following starts with no call at all.
    assert dict(runner.calls) == {"sbatch": 3}
    attached = launcher.attach(handles[0].job_id, handles[0].job_dir)
    states: list[JobState] = []

    def poll() -> None:
        states.extend(handle.state() for handle in [*handles, attached] for _ in range(3))

    threads = [threading.Thread(target=poll) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert runner.calls["squeue"] == 1
    assert runner.calls["scontrol"] == 0
    assert len(states) == 4 * 4 * 3
    assert set(states) <= {JobState.PENDING, JobState.RUNNING}
    assert sum("instance_type='ml.g5.xlarge'" in record.getMessage() for record in caplog.records) == 1
    release.touch()
    for handle in handles:
        handle.cancel()  # cancel looks past the long cache period; whatever ran stops or ends well
        assert handle.state() in (JobState.CANCELLED, JobState.SUCCEEDED)


def test_failed_job_is_described_with_state_reason_and_exit_code(
    slurm_launcher: SlurmLauncher, tmp_path: Path
) -> None:
    handle = slurm_launcher.submit(fixture_job(tmp_path / "job", "fail.py", "boom for the runbook"))
    assert finish(handle) is JobState.FAILED
    status = handle.status()
    assert (status.state, status.reason, status.exit_code) == ("FAILED", "NonZeroExitCode", 1)
    assert handle.describe() == f"slurm job {handle.job_id} FAILED (reason NonZeroExitCode, exit code 1)"
    assert "ValueError: boom for the runbook" in handle.logs()


def test_a_job_records_its_exit_in_the_job_dir_for_when_slurm_has_forgotten_it(
    slurm_launcher: SlurmLauncher, tmp_path: Path
) -> None:
    """The batch script's EXIT trap writes ``<exit code> <submission id> <job id>``: once Slurm has
    purged an ended job (MinJobAge, one hour on the test cluster, so the purge itself is the
    simulation's: ``tests/simulation``), its status comes from that file, a job that exited 0
    COMPLETED, and an intent whose job id never reached the record finds its job there."""
    done = slurm_launcher.submit(fixture_job(tmp_path / "done", "succeed.py"))
    failed = slurm_launcher.submit(fixture_job(tmp_path / "failed", "fail.py", "boom"))
    assert finish(done) is JobState.SUCCEEDED and finish(failed) is JobState.FAILED
    for handle, code, state in ((done, 0, "COMPLETED"), (failed, 1, "FAILED")):
        record = read_submission(JobPaths(handle.job_dir))
        assert record is not None
        recorded = JobPaths(handle.job_dir).exit_code.read_text()
        assert recorded == f"{code} {record.submission_id} {handle.job_id}\n"
        forgotten = recorded_status(handle.job_id, TrackedJob(handle.job_dir, record))
        assert forgotten is not None and (forgotten.state, forgotten.exit_code) == (state, code)


def test_purged_or_unknown_job_is_failed_with_a_clear_reason(
    slurm_launcher: SlurmLauncher, tmp_path: Path
) -> None:
    handle = slurm_launcher.attach(UNKNOWN_JOB_ID, tmp_path / "never submitted")
    assert handle.state() is JobState.FAILED
    assert f"slurm no longer knows job {UNKNOWN_JOB_ID}" in handle.status().reason
    assert handle.describe().startswith(f"slurm job {UNKNOWN_JOB_ID} FAILED (reason slurm no longer knows")
    handle.cancel()  # nothing to cancel: no error, outcome unchanged
    assert handle.state() is JobState.FAILED


def test_resubmit_clears_the_outcome_and_keeps_logs_and_checkpoints(
    slurm_launcher: SlurmLauncher, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    release = tmp_path / "release"
    first = slurm_launcher.submit(fixture_job(job_dir, "fail.py", "first attempt failed"))
    with pytest.raises(JobError, match="has not ended"):
        slurm_launcher.submit(fixture_job(job_dir, "succeed.py"))
    assert finish(first) is JobState.FAILED
    paths = JobPaths(job_dir)
    paths.cancelled.write_text("left by an earlier cancel")
    kept = paths.checkpoints / "step-000001" / "state.bin"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"weights")

    second = slurm_launcher.submit(fixture_job(job_dir, "succeed.py", str(release)))
    assert not paths.cancelled.exists()
    release.touch()
    assert finish(second) is JobState.SUCCEEDED, second.logs()
    assert "first attempt failed" in paths.stderr.read_text()
    assert kept.read_bytes() == b"weights"
    with pytest.raises(JobError, match=f"names job {second.job_id}"):
        slurm_launcher.attach(first.job_id, job_dir)


def test_attach_refuses_what_is_not_a_slurm_job_id(slurm_launcher: SlurmLauncher, tmp_path: Path) -> None:
    with pytest.raises(JobError, match="not a slurm job id"):
        slurm_launcher.attach("local-1-1", tmp_path)


def test_pending_job_shows_slurms_reason_and_cancels(slurm_launcher: SlurmLauncher, tmp_path: Path) -> None:
    # A job that cannot start (more nodes than the cluster has) stays PENDING with Slurm's reason.
    job = fixture_job(tmp_path / "job", "succeed.py", resources=Resources(num_nodes=2))
    handle = slurm_launcher.submit(job)
    try:
        wait_until(lambda: handle.status().reason not in ("", "None"), "a pending reason")
        assert handle.state() is JobState.PENDING
        assert handle.status().state == "PENDING"
    finally:
        handle.cancel()
    assert handle.state() is JobState.CANCELLED


def test_a_stop_gives_the_tasks_the_jobs_stop_grace_instead_of_killwait(tmp_path: Path) -> None:
    """Real fault: tunepod stops a running job (as a prune, a pause or an exploit does) whose script
    needs 12 s to save after SIGTERM, past the test cluster's KillWait of 10 s. With
    ``resources.stop_grace_s: 30`` only its tasks get SIGTERM (``scancel --signal=TERM``), the batch
    script is left to end the job when they exit, and the script saves and exits 0. A plain scancel
    (what a job without the setting gets) would SIGKILL it after KillWait, mid-save."""
    launcher = SlurmLauncher(slurm_spec(tmp_path / "shared"))
    job = fixture_job(tmp_path / "graced", "slow_save.py", "12", resources=Resources(stop_grace_s=30))
    handle = launcher.submit(job)
    wait_until(lambda: (job.job_dir / "started").exists(), "the script to start")
    handle.cancel(reason="pruned")
    saved = json.loads((job.job_dir / "saved").read_text())
    assert saved["saved_at"] - saved["signal_at"] >= 12  # it outlived KillWait
    assert (handle.status().state, handle.status().exit_code) == ("COMPLETED", 0)


def test_render_is_the_batch_script_slurmctld_stored(tmp_path: Path) -> None:
    """``tunepod render``'s script for a trial is byte for byte the one Slurm keeps for its job (but for
    the submission id, drawn anew by each submit)."""
    block = {"kind": "slurm", "python": sys.executable, "poll_cache_s": 0.2}
    preview, launcher = preview_first_trial(tmp_path, block, SlurmLauncher)
    handle = launcher.submit(preview.job)
    try:
        stored = subprocess.run(
            ["scontrol", "write", "batch_script", handle.job_id, "-"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    finally:
        handle.cancel()
    record = read_submission(preview.job.paths)
    assert record is not None and record.job_id == handle.job_id
    assert stored == as_submitted(preview.rendered.payload, preview, record.submission_id)
    assert preview.rendered.payload in preview.text()
