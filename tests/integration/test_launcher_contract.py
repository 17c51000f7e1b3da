"""The launcher contract against ``LocalLauncher`` (real torchrun process trees), plus local-only tests:
pid reuse, zombies, awkward paths, resubmission into a used job dir, warn-once, SIGKILL escalation."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from launcher_contract import (
    JOBS,
    LauncherContract,
    finish,
    fixture_job,
    is_alive,
    recorded_pids,
    wait_until,
)

from tunepod.errors import JobError
from tunepod.launch.base import JobHandle, JobSpec, JobState, Launcher, Resources
from tunepod.launch.local import (
    LocalJob,
    LocalLauncher,
    job_argv,
    read_exit_code,
    read_process_stat,
    torchrun_argv,
)
from tunepod.launch.local.processes import LinuxProcesses, submission_processes
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import Submission, write_submission

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def local_launcher(tmp_path: Path) -> LocalLauncher:
    return LocalLauncher(tmp_path / "shared", cancel_grace_s=5.0)


class TestLocalLauncherContract(LauncherContract):
    @pytest.fixture
    def launcher(self, local_launcher: LocalLauncher) -> Launcher:
        return local_launcher

    def restart(self, launcher: Launcher) -> Launcher:
        assert isinstance(launcher, LocalLauncher)
        return LocalLauncher(
            launcher.root,
            cancel_grace_s=launcher.cancel_grace_s,
            python=launcher.python,
            direct_single_process=launcher.direct_single_process,
        )

    def kill_hard(self, handle: JobHandle) -> None:
        assert isinstance(handle, LocalJob)
        # Loop: a process could be forking while the first round of kills lands.
        while pids := handle.pids():
            for pid in pids:
                _kill(pid, signal.SIGKILL)

    def leftover_processes(self, handle: JobHandle, pid_dir: Path) -> list[int]:
        assert isinstance(handle, LocalJob)
        return sorted(set(super().leftover_processes(handle, pid_dir)) | set(handle.pids()))

    def jobs_named(self, launcher: Launcher, name: str) -> list[str]:
        # A local job's name is its id, and its wrapper is the one session leader carrying it: two
        # wrappers with one id would be two jobs. An ended job has left its exit file instead.
        submission_id = name.removeprefix("local-")
        processes = submission_processes(LinuxProcesses(), submission_id)
        leaders = [pid for pid, stat in processes if stat.pgid == pid]
        if leaders:
            return [name] * len(leaders)
        exit_files = [
            p
            for p in launcher_root_job_dirs(launcher)
            if read_exit_code(JobPaths(p), submission_id) is not None
        ]
        return [name] * len(exit_files)


def launcher_root_job_dirs(launcher: Launcher) -> list[Path]:
    """The job dirs of a contract test: ``tmp_path/job`` beside the launcher's root ``tmp_path/shared``."""
    assert isinstance(launcher, LocalLauncher)
    return [p for p in launcher.root.parent.iterdir() if p.is_dir()]


def record(job_id: str, details: dict[str, object]) -> Submission:
    """A submission record of a job that ``job_id`` names, as the launcher writes it."""
    return Submission(
        backend="local",
        name=job_id,
        attempt=1,
        submission_id=job_id.removeprefix("local-"),
        job_id=job_id,
        details=details,
        intent_at="now",
    )


def _kill(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def test_local_launcher_implements_the_protocol(local_launcher: LocalLauncher) -> None:
    assert isinstance(local_launcher, Launcher)
    assert local_launcher.kind == "local"


def test_torchrun_argv_runs_procs_per_node_processes_on_this_machine(tmp_path: Path) -> None:
    job = JobSpec(
        name="t",
        entrypoint=Path("train.py"),
        job_dir=tmp_path,
        args=("--lr", "0.1"),
        resources=Resources(procs_per_node=3),
    )
    torchrun = ["/py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    assert torchrun_argv(job, "/py") == [*torchrun, "train.py", "--lr", "0.1"]
    assert job_argv(job, "/py") == torchrun_argv(job, "/py")


def test_a_job_of_one_process_skips_torchrun_unless_told_not_to(tmp_path: Path) -> None:
    job = JobSpec(name="t", entrypoint=Path("train.py"), job_dir=tmp_path, args=("--lr", "0.1"))
    direct = job_argv(job, "/py")
    assert direct[0] == "/usr/bin/env"
    assert direct[-3:] == ["train.py", "--lr", "0.1"] and direct[-4] == "/py"
    assert "torch.distributed.run" not in direct
    assert job_argv(job, "/py", direct_single_process=False) == torchrun_argv(job, "/py")


def test_a_direct_job_sees_what_torchrun_would_have_set(tmp_path: Path) -> None:
    """The same one-process job under torchrun and started directly: every variable torchrun sets is
    there with the same value, a process group initializes, and only torchrun's run has an agent."""
    seen = {}
    for direct in (True, False):
        launcher = LocalLauncher(tmp_path / f"shared-{direct}", direct_single_process=direct)
        out = tmp_path / f"seen-{direct}.json"
        job = fixture_job(tmp_path / f"job-{direct}", "rank_env.py", str(out))
        handle = launcher.submit(job)
        assert finish(handle) is JobState.SUCCEEDED, handle.logs()
        seen[direct] = json.loads(out.read_text())
    assert seen[True]["env"] == seen[False]["env"]
    assert seen[True]["env"]["RANK"] == "0" and seen[True]["env"]["WORLD_SIZE"] == "1"
    assert seen[True]["world_size"] == seen[False]["world_size"] == 1
    assert "torch.distributed.run" in seen[False]["parent"]
    assert seen[True]["parent"][:2] == ["/bin/sh", "-c"]  # the exit-recording wrapper, no agent


def test_pid_reused_by_a_stranger_is_not_our_job(local_launcher: LocalLauncher, tmp_path: Path) -> None:
    job = fixture_job(tmp_path / "job", "succeed.py")
    handle = local_launcher.submit(job)
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()
    # A live process, leader of its own group, now holds the pid (and pgid) the submission names.
    stranger = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        submission = json.loads(job.paths.submission.read_text())
        submission["details"]["pid"] = stranger.pid  # the start time stays our wrapper's
        job.paths.submission.write_text(json.dumps(submission))
        attached = local_launcher.attach(handle.job_id, job.job_dir)
        assert attached.state() is JobState.SUCCEEDED
        assert attached.pids() == []
        attached.cancel()
        assert stranger.poll() is None, "cancel killed a process that is not part of the job"
    finally:
        stranger.kill()
        stranger.wait()


def test_zombie_wrapper_counts_as_dead(local_launcher: LocalLauncher, tmp_path: Path) -> None:
    zombie = subprocess.Popen(["true"], start_new_session=True)  # exits at once; reaped only by wait()
    try:
        wait_until(lambda: (stat := read_process_stat(zombie.pid)) is not None and stat.is_dead, "a zombie")
        stat = read_process_stat(zombie.pid)
        assert stat is not None
        paths = JobPaths(tmp_path / "job")
        paths.job_dir.mkdir()
        job_id = "local-00000000000000aa"
        details = {"pid": zombie.pid, "start_ticks": stat.start_ticks}
        write_submission(paths, record(job_id, details))
        assert local_launcher.attach(job_id, paths.job_dir).state() is JobState.FAILED
    finally:
        zombie.wait()


def test_idle_ends_with_the_job_and_sleeps_when_there_is_nothing_to_wait_on(
    local_launcher: LocalLauncher, tmp_path: Path
) -> None:
    """The driver idles on the handle between two polls: a local job's idle returns when its wrapper
    exits (a pidfd), not after the whole wait; with no wrapper left it sleeps its time, never spins."""
    handle = local_launcher.submit(fixture_job(tmp_path / "job", "hang.py", str(tmp_path / "pids")))
    wait_until(lambda: (tmp_path / "pids" / "rank-0.json").exists(), "the job to start")
    ended = threading.Event()
    idler = threading.Thread(target=lambda: (handle.idle(600.0), ended.set()))
    idler.start()
    assert not ended.wait(1.0), "idle returned while the job ran"
    handle.cancel()
    idler.join(timeout=60)
    assert ended.is_set(), "idle went on after the job had ended"
    assert handle.state() is JobState.CANCELLED
    started = time.monotonic()
    handle.idle(0.3)
    assert time.monotonic() - started >= 0.3


def test_paths_with_spaces_and_quotes_need_no_quoting(local_launcher: LocalLauncher, tmp_path: Path) -> None:
    weird = tmp_path / 'it\'s a "quoted" $HOME `dir`; *'
    weird.mkdir()
    script = weird / "echo 'args'.py"
    shutil.copy(JOBS / "echo_args.py", script)
    out = weird / "out $1.json"
    args = ("$HOME", "a  b", "it's", '"q"', "`id`", "*", "$(true)", "")
    job = dataclasses.replace(
        fixture_job(weird / "job $dir", "echo_args.py", str(out), *args), entrypoint=script
    )
    handle = local_launcher.submit(job)
    assert finish(handle) is JobState.SUCCEEDED, handle.logs()
    assert json.loads(out.read_text()) == list(args)
    assert handle.exit_code == 0


def test_resubmit_clears_the_outcome_and_keeps_logs_and_checkpoints(
    local_launcher: LocalLauncher, tmp_path: Path
) -> None:
    job_dir = tmp_path / "job"
    first = local_launcher.submit(fixture_job(job_dir, "fail.py", "first attempt failed"))
    assert finish(first) is JobState.FAILED
    paths = JobPaths(job_dir)
    paths.cancelled.write_text("left by an earlier cancel")
    kept = paths.checkpoints / "step-000001" / "state.bin"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"weights")

    second = local_launcher.submit(fixture_job(job_dir, "succeed.py"))
    assert finish(second) is JobState.SUCCEEDED, second.logs()
    assert not paths.cancelled.exists()
    assert "first attempt failed" in paths.stderr.read_text()
    assert kept.read_bytes() == b"weights"
    with pytest.raises(JobError, match=f"names job {second.job_id}"):
        local_launcher.attach(first.job_id, job_dir)


def test_submit_refuses_the_job_dir_of_a_running_job(local_launcher: LocalLauncher, tmp_path: Path) -> None:
    release = tmp_path / "release"
    job = fixture_job(tmp_path / "job", "succeed.py", str(release))
    running = local_launcher.submit(job)
    with pytest.raises(JobError, match=r"belongs to local job .* which has not ended"):
        local_launcher.submit(job)
    release.touch()
    assert finish(running) is JobState.SUCCEEDED, running.logs()


def test_attach_explains_a_foreign_job_id(local_launcher: LocalLauncher, tmp_path: Path) -> None:
    with pytest.raises(JobError, match="not a local job id"):
        local_launcher.attach("4412", tmp_path)


def test_attach_without_a_record_finds_the_job_by_its_submission_id(
    local_launcher: LocalLauncher, tmp_path: Path
) -> None:
    """The record holds only the wrapper's pid, a shortcut: the processes carry the job's id."""
    pid_dir = tmp_path / "pids"
    job = fixture_job(tmp_path / "job", "hang.py", str(pid_dir))
    submitted = local_launcher.submit(job)
    wait_until(lambda: (pid_dir / "rank-0.json").exists(), "the rank to start")
    job.paths.submission.unlink()
    attached = LocalLauncher(local_launcher.root).attach(submitted.job_id, job.job_dir)
    assert attached.state() is JobState.RUNNING
    attached.cancel()
    assert [pid for pid in recorded_pids(pid_dir) if is_alive(pid)] == []


def test_warns_once_per_launcher_about_resources_it_ignores(
    local_launcher: LocalLauncher, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tunepod.launch.local")
    ignored = Resources(num_nodes=2, procs_per_node=1, instance_type="ml.g5.xlarge")
    for attempt in range(2):
        handle = local_launcher.submit(
            fixture_job(tmp_path / f"job{attempt}", "succeed.py", resources=ignored)
        )
        assert finish(handle) is JobState.SUCCEEDED, handle.logs()
    warnings = [record.getMessage() for record in caplog.records]
    assert sum("num_nodes=2" in message for message in warnings) == 1
    assert sum("instance_type='ml.g5.xlarge'" in message for message in warnings) == 1


class DiesAfterStart(LinuxProcesses):
    """Real processes, except that the orchestrator dies as soon as the job's wrapper has started:
    only the intent written before starting it is on disk. Stand-in: an exception no caller catches
    in place of the process dying, which a test cannot time between the start and the record."""

    def start(self, argv: Sequence[str], env: Mapping[str, str], stdout: Path, stderr: Path) -> int:
        pid = super().start(argv, env, stdout, stderr)
        raise KeyboardInterrupt(f"orchestrator killed after starting wrapper {pid}")


def test_a_job_found_after_a_crash_keeps_its_stop_grace(tmp_path: Path) -> None:
    """The orchestrator died between starting a job with ``resources.stop_grace_s: 20`` and recording
    it; a restarted one finds the job by its submission id. Stopping it (a prune) must give it that
    grace, as for a job recorded normally: its script needs 2 s to save after SIGTERM and does. The
    launcher's own ``cancel_grace_s`` (0.5 s) would SIGKILL it mid-save."""
    root = tmp_path / "shared"
    job = fixture_job(tmp_path / "graced", "slow_save.py", "2", resources=Resources(stop_grace_s=20))
    with pytest.raises(KeyboardInterrupt):
        LocalLauncher(root, cancel_grace_s=0.5, processes=DiesAfterStart()).submit(job)
    found = LocalLauncher(root, cancel_grace_s=0.5).recorded(job.job_dir)
    assert found is not None
    wait_until(lambda: (job.job_dir / "started").exists(), "the script to start")

    found.cancel(reason="pruned")

    saved = job.job_dir / "saved"
    assert saved.exists(), f"killed mid-save: {found.describe()}"
    times = json.loads(saved.read_text())
    assert times["saved_at"] - times["signal_at"] >= 2
    assert found.state() is JobState.SUCCEEDED


def test_cancel_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path: Path) -> None:
    launcher = LocalLauncher(tmp_path / "shared", cancel_grace_s=0.5)
    pid_dir = tmp_path / "pids"
    handle = launcher.submit(
        fixture_job(tmp_path / "job", "hang.py", str(pid_dir), "--ignore-sigterm", procs=2)
    )
    wait_until(lambda: len(list(pid_dir.glob("rank-*.json"))) == 2, "both ranks to start")
    handle.cancel()
    assert handle.state() is JobState.CANCELLED
    assert [pid for pid in recorded_pids(pid_dir) if is_alive(pid)] == []
    assert handle.pids() == []


def test_cancel_and_state_from_several_threads(local_launcher: LocalLauncher, tmp_path: Path) -> None:
    pid_dir = tmp_path / "pids"
    handle = local_launcher.submit(fixture_job(tmp_path / "job", "hang.py", str(pid_dir)))
    wait_until(lambda: (pid_dir / "rank-0.json").exists(), "the rank to start")
    errors: list[BaseException] = []

    def cancel_and_check() -> None:
        try:
            handle.state()
            handle.cancel()
            assert handle.state() is JobState.CANCELLED
        except BaseException as exc:  # collected: an exception in a thread would not fail the test
            errors.append(exc)

    threads = [threading.Thread(target=cancel_and_check) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert handle.pids() == []


def test_logs_tail_prefers_stderr_then_falls_back_to_stdout(tmp_path: Path) -> None:
    paths = JobPaths(tmp_path)
    # A job whose processes are long gone: a pid at pid_max cannot exist.
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    launcher = LocalLauncher(tmp_path, cancel_grace_s=1)
    job = LocalJob(
        launcher,
        "local-00000000000000bb",
        tmp_path,
        record("local-00000000000000bb", {"pid": pid_max, "start_ticks": 0}),
    )
    assert job.logs() == ""
    paths.stdout.write_text("".join(f"out {i}\n" for i in range(100_000)))
    assert job.logs(tail=2) == "out 99998\nout 99999"
    paths.stderr.write_text("err 1\nerr 2\n")
    assert job.logs(tail=1) == "err 2"
    assert job.logs() == "err 1\nerr 2"
