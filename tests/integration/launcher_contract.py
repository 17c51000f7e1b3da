"""The launcher contract, as one test class every backend runs (Optuna's storage-test style).

A backend's test module subclasses ``LauncherContract`` and provides:

- a ``launcher`` fixture: a fresh launcher whose jobs can run the scripts in ``tests/fixtures/jobs``
  and see the test's ``tmp_path`` (a shared filesystem for a cluster backend);
- ``restart(launcher)``: a new launcher object for the same backend and root, standing in for an
  orchestrator that restarted and lost every handle;
- ``kill_hard(handle)``: crash the job the way a node failure would (local: SIGKILL every process);
  together with ``resume_after_crash`` (default: wait for the crashed job to end, then submit the
  same job into the same job dir), which a backend that requeues by itself (Slurm) overrides;
- ``jobs_named(launcher, name)``: the ids of every job the backend holds under a name, to prove that
  a lost reply or a crash between create and record never leaves two jobs.

``leftover_processes`` reads the pids the ``hang.py`` fixture records, so it works for any backend
whose jobs run on this machine; a remote backend overrides it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tunepod import runtime
from tunepod.errors import JobError, TransientError
from tunepod.launch.base import (
    Accepted,
    JobHandle,
    JobSpec,
    JobState,
    Launcher,
    LauncherBase,
    Resources,
    wait,
)
from tunepod.launch.drive import DriveSettings, JobDriver, Outcome
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import read_cancel_marker, read_submission, write_submission
from tunepod.launch.watchdog import Limits
from tunepod.runtime.progress import HEARTBEAT_S_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
JOBS = REPO_ROOT / "tests" / "fixtures" / "jobs"
# Bounds on how long a test waits for a job; they only stop a broken test from hanging, nothing is
# asserted about speed.
JOB_TIMEOUT_S = 90.0
POLL_S = 0.05
# A loop idle this long is hung: with heartbeats every 0.5 s, seen within seconds.
HANG_TIMEOUT_S = 3.0


def fixture_job(
    job_dir: Path, script: str, *args: str, procs: int = 1, resources: Resources | None = None
) -> JobSpec:
    """A job running ``tests/fixtures/jobs/<script>`` with the runtime contract pointing into ``job_dir``."""
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    paths = JobPaths(job_dir)
    env = {
        "PYTHONPATH": pythonpath,  # the fixtures import tunepod.runtime from this checkout
        runtime.CHECKPOINT_DIR_ENV: str(paths.checkpoints),
        runtime.RESULT_FILE_ENV: str(paths.result),
        runtime.METRICS_FILE_ENV: str(paths.metrics),
    }
    return JobSpec(
        name=job_dir.name,
        entrypoint=JOBS / script,
        job_dir=job_dir,
        args=args,
        env=env,
        resources=resources or Resources(procs_per_node=procs),
    )


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = JOB_TIMEOUT_S) -> None:
    """Poll ``condition`` until it holds; fail the test naming ``what`` if it never does."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what} after {timeout_s:.0f}s")
        time.sleep(POLL_S)


def finish(handle: JobHandle) -> JobState:
    """The terminal state of ``handle``; fails the test with the job's logs if it never ends."""
    state = wait(handle, poll_s=POLL_S, timeout_s=JOB_TIMEOUT_S)
    if not state.is_terminal:
        pytest.fail(f"job {handle.job_id} still {state} after {JOB_TIMEOUT_S:.0f}s; logs:\n{handle.logs()}")
    return state


def recorded_pids(pid_dir: Path) -> list[int]:
    """Every pid the ``hang.py`` ranks recorded under ``pid_dir``."""
    files = sorted(pid_dir.glob("rank-*.json"))
    return [pid for file in files for pid in json.loads(file.read_text())["pids"]]


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (state Z) has exited and counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X")


class LauncherContract:
    """What every launcher must do; see the module docstring for what a subclass provides."""

    @pytest.fixture
    def launcher(self) -> Launcher:
        raise NotImplementedError("a backend's test class provides the launcher fixture")

    def restart(self, launcher: Launcher) -> Launcher:
        raise NotImplementedError

    def kill_hard(self, handle: JobHandle) -> None:
        raise NotImplementedError

    def resume_after_crash(self, launcher: Launcher, job: JobSpec, crashed: JobHandle) -> JobHandle:
        assert finish(crashed) is JobState.FAILED, crashed.logs()
        return launcher.submit(job)

    def leftover_processes(self, handle: JobHandle, pid_dir: Path) -> list[int]:
        return [pid for pid in recorded_pids(pid_dir) if is_alive(pid)]

    def jobs_named(self, launcher: Launcher, name: str) -> list[str]:
        raise NotImplementedError

    def make_job(self, job_dir: Path, script: str, *args: str, procs: int = 1) -> JobSpec:
        """The contract's jobs; a backend that cannot pass an argv (SageMaker) passes ``args`` another way
        that ``tests/fixtures/jobs/_args.py`` reads."""
        return fixture_job(job_dir, script, *args, procs=procs)

    def checkpoint_step(self, job: JobSpec) -> int | None:
        """The step of the job's latest checkpoint, where the backend keeps it (default: the job's
        checkpoint dir on the shared filesystem)."""
        latest = runtime.latest_checkpoint(job.paths.checkpoints)
        return None if latest is None else latest.step

    # ------------------------------------------------------------------------------------------ tests

    def test_submit_runs_then_succeeds_with_result(self, launcher: Launcher, tmp_path: Path) -> None:
        release = tmp_path / "release"
        job = self.make_job(tmp_path / "job", "succeed.py", str(release), procs=2)
        job = JobSpec(**{**job.__dict__, "env": {**job.env, "SECRET_TOKEN": "s3cr3t"}})
        handle = launcher.submit(job)
        assert handle.state() in (JobState.PENDING, JobState.RUNNING)
        assert handle.state() in (JobState.PENDING, JobState.RUNNING)  # still: it waits for the release
        release.touch()
        assert finish(handle) is JobState.SUCCEEDED, handle.logs()
        result = runtime.read_result(job.paths.result)
        assert result is not None
        assert result.metrics == {"world_size": 2.0}
        self.assert_environment_files_private(launcher, job)

    def assert_environment_files_private(self, launcher: Launcher, job: JobSpec) -> None:
        """The files that hold the job's environment are owner-only, and so is the job dir where the
        jobs run as the submitting user."""
        if launcher.private_job_dirs:
            assert stat.S_IMODE(job.job_dir.stat().st_mode) == 0o700
        holding = [p for p in job.job_dir.iterdir() if p.is_file() and b"s3cr3t" in p.read_bytes()]
        for path in [job.paths.submission, *holding]:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

    def test_failing_job_is_failed_with_traceback_in_logs(self, launcher: Launcher, tmp_path: Path) -> None:
        handle = launcher.submit(self.make_job(tmp_path / "job", "fail.py", "boom from the contract test"))
        assert finish(handle) is JobState.FAILED
        assert "ValueError: boom from the contract test" in handle.logs()
        assert "exit code 1" in handle.describe()

    def test_cancel_stops_every_process(self, launcher: Launcher, tmp_path: Path) -> None:
        pid_dir = tmp_path / "pids"
        job = self.make_job(tmp_path / "job", "hang.py", str(pid_dir), procs=2)
        handle = launcher.submit(job)
        wait_until(lambda: len(list(pid_dir.glob("rank-*.json"))) == 2, "both ranks to start")
        handle.cancel(reason="pruned")
        assert handle.state() is JobState.CANCELLED
        marker = read_cancel_marker(job.paths)  # written, with the reason, before the stop was sent
        assert marker is not None and (marker.job_id, marker.reason) == (handle.job_id, "pruned")
        assert self.leftover_processes(handle, pid_dir) == []
        handle.cancel()  # idempotent
        assert handle.state() is JobState.CANCELLED
        assert not job.paths.result.exists()

    def test_cancel_after_the_end_keeps_the_outcome(self, launcher: Launcher, tmp_path: Path) -> None:
        handle = launcher.submit(self.make_job(tmp_path / "job", "succeed.py"))
        assert finish(handle) is JobState.SUCCEEDED, handle.logs()
        handle.cancel()
        assert handle.state() is JobState.SUCCEEDED

    def test_attach_after_restart_follows_to_success(self, launcher: Launcher, tmp_path: Path) -> None:
        release = tmp_path / "release"
        job = self.make_job(tmp_path / "job", "succeed.py", str(release))
        submitted = launcher.submit(job)
        attached = self.restart(launcher).attach(submitted.job_id, job.job_dir)
        assert attached.job_id == submitted.job_id
        assert attached.state() in (JobState.PENDING, JobState.RUNNING)
        release.touch()
        assert finish(attached) is JobState.SUCCEEDED, attached.logs()
        assert runtime.read_result(job.paths.result) is not None

    def test_attach_after_restart_can_cancel(self, launcher: Launcher, tmp_path: Path) -> None:
        pid_dir = tmp_path / "pids"
        job = self.make_job(tmp_path / "job", "hang.py", str(pid_dir))
        submitted = launcher.submit(job)
        wait_until(lambda: (pid_dir / "rank-0.json").exists(), "the rank to start")
        attached = self.restart(launcher).attach(submitted.job_id, job.job_dir)
        assert attached.state() is JobState.RUNNING
        attached.cancel()
        assert attached.state() is JobState.CANCELLED
        assert submitted.state() is JobState.CANCELLED
        assert self.leftover_processes(attached, pid_dir) == []

    def test_resubmit_after_crash_resumes_from_checkpoint(self, launcher: Launcher, tmp_path: Path) -> None:
        num_steps, pause_at = 5, 2
        job = self.make_job(tmp_path / "job", "count.py", str(num_steps), str(pause_at))
        crashed = launcher.submit(job)

        wait_until(lambda: self.checkpoint_step(job) == pause_at, f"checkpoint step {pause_at}")
        self.kill_hard(crashed)
        resumed = self.resume_after_crash(launcher, job, crashed)
        assert finish(resumed) is JobState.SUCCEEDED, resumed.logs()
        result = runtime.read_result(job.paths.result)
        assert result is not None
        assert result.metrics == {"resumed_from": pause_at + 1, "count": num_steps}
        steps = [report.step for report in runtime.read_reports(job.paths.metrics)]
        assert steps == list(range(num_steps))  # each step reported once: no step redone, none skipped

    def test_a_hung_job_is_stopped_and_resumed_from_its_checkpoint(
        self, launcher: Launcher, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The driver's hang detection on this backend: the job's first run stops advancing after its
        step-1 checkpoint while its heartbeat thread beats on (alive and stuck); after
        ``hang_timeout_s`` the driver says so, stops the job through the backend (scancel, a delete,
        StopTrainingJob) and starts attempt 2, which resumes from that checkpoint and finishes."""
        caplog.set_level(logging.WARNING, logger="tunepod")
        job = self.make_job(tmp_path / "job", "count.py", "4", "1").with_env({HEARTBEAT_S_ENV: "0.5"})
        job = dataclasses.replace(job, limits=Limits(hang_timeout_s=HANG_TIMEOUT_S))
        settings = DriveSettings(poll_s=0.2, max_restarts=1)
        driven = JobDriver(launcher, job, settings, what="the contract's job").run()
        assert driven.outcome is Outcome.COMPLETED, driven.message
        assert driven.result is not None and driven.result.metrics == {"resumed_from": 2, "count": 4}
        record = read_submission(job.paths)
        assert record is not None and record.attempt == 2
        assert "is hung, stopping it: no progress for" in caplog.text
        assert "hung; restart 1 of 1, resuming from its checkpoints" in caplog.text
        assert [report.step for report in runtime.read_reports(job.paths.metrics)] == [0, 1, 2, 3]

    # ------------------------------------------------------------------------------ exactly once

    def test_lost_reply_after_create_adopts_the_job(
        self, launcher: Launcher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The backend accepts the job, then the reply is lost (an ssh drop, a timed-out API call).
        Stand-in: the real send runs, then a TransientError is raised in its place, since a dropped
        reply after acceptance cannot be timed from here. submit must find and adopt the job."""
        assert isinstance(launcher, LauncherBase)
        real_send = launcher.send

        def reply_lost(job: JobSpec, rendered: object, intent: object) -> Accepted:
            real_send(job, rendered, intent)  # type: ignore[arg-type]
            raise TransientError("connection closed before the reply arrived")

        monkeypatch.setattr(launcher, "send", reply_lost)
        release = tmp_path / "release"
        job = self.make_job(tmp_path / "job", "succeed.py", str(release))
        handle = launcher.submit(job)
        record = read_submission(job.paths)
        assert record is not None and record.job_id == handle.job_id
        assert self.jobs_named(launcher, record.name) == [handle.job_id]
        release.touch()
        assert finish(handle) is JobState.SUCCEEDED, handle.logs()

    def test_crash_between_create_and_record_is_resolved_by_name(
        self, launcher: Launcher, tmp_path: Path
    ) -> None:
        """Only the intent reached the job dir (the orchestrator died right after the backend took the
        job): the job is found by its name and submission id, never created a second time."""
        assert isinstance(launcher, LauncherBase)
        release = tmp_path / "release"
        job = self.make_job(tmp_path / "job", "succeed.py", str(release))
        submitted = launcher.submit(job)
        record = read_submission(job.paths)
        assert record is not None
        write_submission(job.paths, record.model_copy(update={"job_id": None, "submitted_at": None}))

        restarted = self.restart(launcher)
        found = restarted.recorded(job.job_dir)  # type: ignore[attr-defined]
        assert found is not None and found.job_id == submitted.job_id
        assert (
            read_submission(job.paths) is not None and read_submission(job.paths).job_id == submitted.job_id
        )
        with pytest.raises(JobError, match="has not ended"):
            restarted.submit(job)
        assert self.jobs_named(launcher, record.name) == [submitted.job_id]
        release.touch()
        assert finish(found) is JobState.SUCCEEDED, found.logs()

    def test_crash_before_create_sends_once_under_the_recorded_name(
        self, launcher: Launcher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The intent was written, then the orchestrator died before the backend heard of the job
        (stand-in: send raises instead of the process dying). The next submit sends that same
        attempt once, under the recorded name."""
        assert isinstance(launcher, LauncherBase)

        def died(job: JobSpec, rendered: object, intent: object) -> Accepted:
            raise KeyboardInterrupt("orchestrator killed before sending")

        job = self.make_job(tmp_path / "job", "succeed.py")
        with monkeypatch.context() as patch:
            patch.setattr(launcher, "send", died)
            with pytest.raises(KeyboardInterrupt):
                launcher.submit(job)
        intent = read_submission(job.paths)
        assert intent is not None and intent.is_intent and intent.attempt == 1

        restarted = self.restart(launcher)
        assert restarted.recorded(job.job_dir) is None  # type: ignore[attr-defined]
        handle = restarted.submit(job)
        record = read_submission(job.paths)
        assert record is not None
        assert (record.attempt, record.name, record.submission_id) == (1, intent.name, intent.submission_id)
        assert finish(handle) is JobState.SUCCEEDED, handle.logs()
        assert self.jobs_named(launcher, record.name) == [handle.job_id]
