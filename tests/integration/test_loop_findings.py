"""Regression tests for the tuning loop's defects of issue 28 (each failed on the code before its fix),
against real components: real local jobs, a real journal study, real leases, a real full filesystem.
Where a fault cannot be made for real inside a test, the test says what stands in for it.

The deterministic simulation (``tests/simulation``, ``make simulate``) explores these and every
other interleaving; these tests pin the ones it and the review found.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import optuna
import pytest
from integration.test_exactly_once import job_dir, no_process_left, orchestrate, study, wait_for
from integration.test_tuner import make_tuner, settings
from optuna.storages.journal import JournalStorage
from optuna.study import StudyDirection
from tmpfs import MiB, fill, mounted_tmpfs

from tunepod.errors import DiskFullError
from tunepod.hpo.population import lineage
from tunepod.hpo.study import make_storage
from tunepod.launch.base import JobSpec
from tunepod.launch.contract import contract_env
from tunepod.launch.drive import DriveSettings, JobDriver
from tunepod.launch.lease import LeaseRecord, Leases, read_lease
from tunepod.launch.local import LocalLauncher
from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import CancelReason, read_cancel_marker, read_submission
from tunepod.runtime.files import write_bytes_atomic

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LONG_TRIAL = {"epochs": 200, "sleep_s": 0.5}


def test_leases_a_failed_ask_leaves_behind_are_let_go(tmp_path: Path) -> None:
    """Defect 2: the tuner claims two trials an earlier (SIGKILLed) run left RUNNING, then asking for a
    new one fails: the study's journal sits on a small filesystem that is full (a real ENOSPC). The
    claimed trials' leases must be let go with the failure; held on by this process's heartbeat,
    they kept every later run (a Prefect retry of the step) following them forever."""
    with mounted_tmpfs(tmp_path / "fs", 2 * MiB) as fs:
        overrides = {
            "num_trials": 3,
            "num_parallel": 2,
            "train": {"args": LONG_TRIAL},
            "study": {"storage": f"journal://{fs}/optuna.log"},
        }
        first = orchestrate(tmp_path, overrides)
        wait_for(lambda: all(JobPaths(job_dir(tmp_path, n)).running.exists() for n in (0, 1)), "two trials")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        # Made (the study opened) before the journal's filesystem fills: the run must fail at its ask.
        tuner = make_tuner(tmp_path, settings(tmp_path, **{**overrides, "num_parallel": 3}))
        filler = fill(fs)
        _fill_last_page(f"journal://{fs}/optuna.log")
        try:
            with pytest.raises(DiskFullError):
                tuner.run()
            for number in (0, 1):
                lease = Leases(private_job_dirs=True).acquire(job_dir(tmp_path, number))
                assert lease is not None, (
                    f"trial {number}'s lease is still held, by an orchestrator not driving it"
                )
                lease.release()
        finally:
            filler.unlink()
            _stop_jobs(tmp_path, [0, 1])


def test_a_trial_left_half_asked_by_a_storage_error_is_asked_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 5: a database error right after Optuna created the new trial (its first parameter write
    fails: stand-in for a lost answer from the study's database, raised in-process, since a database
    that commits and then drops the connection cannot be made here). The retried ask must not leave
    that trial behind to be trained later with the script's defaults: every trial ends with its
    sampled parameters, and the study has exactly num_trials of them."""

    class OperationalError(Exception):
        """What SQLAlchemy raises on a locked database: tunepod retries it as transient."""

    real_set_param = JournalStorage.set_trial_param
    failures = {"left": 1}

    def fails_once(self: JournalStorage, *args: object, **kwargs: object) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise OperationalError("database is locked")
        real_set_param(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(JournalStorage, "set_trial_param", fails_once)
    overrides = {"num_trials": 2, "num_parallel": 1, "train": {"args": {"epochs": 2}}}
    trials = make_tuner(tmp_path, settings(tmp_path, **overrides)).run()

    assert failures["left"] == 0
    stored = study(tmp_path).trials
    assert len(stored) == 2, [t.state for t in stored]
    for trial in stored:
        assert trial.state is optuna.trial.TrialState.COMPLETE
        assert "x" in trial.params, f"trial {trial.number} ran without its parameters"
    assert sorted(record.params["x"] for record in trials.trials) == sorted(t.params["x"] for t in stored)


def test_a_pbt_member_left_half_asked_by_a_crash_is_trained(tmp_path: Path) -> None:
    """Found by the simulation: an orchestrator SIGKILLed just after Optuna created a member's trial,
    before its job dir was recorded. Under PBT the half-asked trial counted as an asked member, so no
    ask ever finished it: every later run ended with that member never trained and its trial RUNNING.
    The window is too narrow to hit from outside, so the orchestrator kills itself (a real SIGKILL)
    as Optuna's storage has created the second member's trial; the rerun must train both members."""
    overrides = {
        "num_trials": 2,
        "num_parallel": 2,
        "train": {"args": {"epochs": 4}},
        "pbt": {"population": 2, "interval": 2, "quantile": 0.5, "max_resource": 4},
    }
    killed_after_creating = """
        from optuna.storages.journal import JournalStorage
        real_create = JournalStorage.create_new_trial
        def create_then_die(self, *args, **kwargs):
            trial_id = real_create(self, *args, **kwargs)
            if trial_id == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return trial_id
        JournalStorage.create_new_trial = create_then_die
    """
    first = orchestrate(tmp_path, overrides, killed_after_creating)
    assert first.wait(90) == -signal.SIGKILL
    assert [t.params for t in study(tmp_path).trials][1] == {}, "the kill did not leave trial 1 half asked"

    make_tuner(tmp_path, settings(tmp_path, **overrides)).run()

    trials = {t.number: t for t in study(tmp_path).trials}
    assert all(t.state.is_finished() for t in trials.values()), {n: t.state for n, t in trials.items()}
    assert "x" in trials[1].params, "the half-asked trial was trained without its parameters"
    for root in (0, 1):
        assert lineage(trials, root)[-1].state is optuna.trial.TrialState.COMPLETE, f"member {root}"
    assert sum(t.state is optuna.trial.TrialState.COMPLETE for t in trials.values()) == 2


def test_a_driver_whose_lease_was_taken_over_acts_no_more(tmp_path: Path) -> None:
    """Defect 9: a driver stalls in the middle of a poll (here: inside its report handler, which waits
    for the takeover) while another orchestrator takes its lease over. Back, it decides to prune:
    that stop must not happen, because the lease is no longer its own, even before its heartbeat
    noticed. The takeover is written into the lease file as another orchestrator's acquire writes it
    (a stall of a whole process, heartbeat included, cannot be made inside this test's process)."""
    launcher = LocalLauncher(tmp_path / "shared", cancel_grace_s=2)
    job = _sleeping_job(tmp_path / "shared" / "jobs" / "trial-0")
    leases = Leases(private_job_dirs=True)
    lease = leases.acquire(job.job_dir)
    assert lease is not None
    taken_over = threading.Event()

    def prune_after_the_takeover(_reports: object) -> CancelReason:
        taken_over.wait(30)
        return "pruned"

    driver = JobDriver(
        launcher,
        job,
        DriveSettings(poll_s=0.2),
        what="trial 0",
        on_reports=prune_after_the_takeover,
        leases=leases,
    )
    outcome: dict[str, BaseException | object] = {}
    thread = threading.Thread(target=lambda: _capture(outcome, lambda: driver.run(lease)), daemon=True)
    thread.start()
    try:
        wait_for(lambda: JobPaths(job.job_dir).metrics.exists(), "the job to report")
        current = read_lease(JobPaths(job.job_dir))
        assert current is not None
        other = current.model_copy(
            update={"owner": "elsewhere:1:taker", "pid": 1, "renewed_at": time.time(), "generation": 2}
        )
        write_bytes_atomic(JobPaths(job.job_dir).lease, other.model_dump_json().encode())
        taken_over.set()
        thread.join(30)
        assert not thread.is_alive()
        assert type(outcome.get("error")).__name__ == "LeaseLost", outcome
        assert read_cancel_marker(JobPaths(job.job_dir)) is None, (
            "the driver stopped a job it no longer drives"
        )
        record = read_submission(JobPaths(job.job_dir))
        assert record is not None and record.job_id is not None
        assert launcher.attach(record.job_id, job.job_dir).pids(), "the job was killed"
    finally:
        taken_over.set()
        _stop_all(launcher, job.job_dir)


def test_an_exploit_of_a_job_that_had_already_died_is_carried_out_after_a_crash(tmp_path: Path) -> None:
    """Found by the simulation: PBT decides to exploit a trial whose job has just died (SIGKILLed), so
    the stop finds nothing to stop; the orchestrator then dies before telling the trial PRUNED. The
    next one must carry the exploit out, not read the dead job as a failure and start it again: the
    decision is in the job dir (the cancel marker is written for an ended job too). The job's process
    group is really SIGKILLed; the orchestrator's crash is its driver returning before the tell (a
    process cannot be killed between two lines of this test)."""
    launcher = LocalLauncher(tmp_path / "shared", cancel_grace_s=2)
    job = _sleeping_job(tmp_path / "shared" / "jobs" / "trial-0")
    paths = JobPaths(job.job_dir)

    def killed_then_exploited(_reports: object) -> CancelReason | None:
        record = read_submission(paths)
        if not paths.metrics.exists() or record is None or record.job_id is None:
            return None
        handle = launcher.attach(record.job_id, job.job_dir)
        os.killpg(handle.pids()[0], signal.SIGKILL)
        wait_for(lambda: handle.state().is_terminal, "the killed job to end")
        return "exploited"

    first = JobDriver(
        launcher,
        job,
        DriveSettings(poll_s=0.2, max_restarts=2),
        what="trial 0",
        on_reports=killed_then_exploited,
    )
    stopped = first.run()
    assert (stopped.outcome.name, stopped.reason) == ("STOPPED", "exploited")
    marker = read_cancel_marker(paths)
    assert marker is not None and marker.reason == "exploited"

    after_the_crash = JobDriver(launcher, job, DriveSettings(poll_s=0.2, max_restarts=2), what="trial 0")
    carried_out = after_the_crash.run()
    assert (carried_out.outcome.name, carried_out.reason) == ("STOPPED", "exploited")
    record = read_submission(paths)
    assert record is not None and record.attempt == 1, "the exploited trial's job was started again"


def test_a_lease_of_another_pid_namespace_is_not_taken_for_a_dead_pid(tmp_path: Path) -> None:
    """Also checked: two orchestrators in containers with their own PID namespaces, maybe with one
    hostname (hostNetwork pods). The holder's pid names nothing (or a stranger) in the taker's
    namespace, so the taker must wait for the TTL instead of taking a live holder's lease."""
    paths = JobPaths(tmp_path / "job")
    paths.job_dir.mkdir()
    import socket

    from tunepod import world

    me = world.this_process()
    holder = LeaseRecord(
        owner="container-b:1:x", host=socket.gethostname(), pid=1_999_999, pid_start_ticks=5,
        boot_id=me.boot_id, pid_namespace="pid:[4026599999]", renewed_at=time.time(), ttl_s=60,
    )  # fmt: skip
    write_bytes_atomic(paths.lease, holder.model_dump_json().encode())
    assert Leases(private_job_dirs=True).acquire(paths.job_dir) is None
    same_namespace = holder.model_copy(update={"pid_namespace": me.pid_namespace})
    write_bytes_atomic(paths.lease, same_namespace.model_dump_json().encode())
    taken = Leases(private_job_dirs=True).acquire(paths.job_dir)
    assert taken is not None, "a dead pid in our own namespace frees the lease at once"
    taken.release()


def test_a_filesystem_without_locks_is_refused_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also checked: NFS mounted with ``nolock`` answers ``flock`` with ENOLCK. Stand-in: ``flock``
    raising ENOLCK in-process (no such mount can be made here). tunepod must refuse, naming the path
    and the fix, never run unlocked."""
    import errno
    import fcntl

    from tunepod.errors import TunepodError
    from tunepod.locks import locked

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with (
        pytest.raises(
            TunepodError, match=r"cannot lock .*lease.lock: its filesystem does not support file locks"
        ),
        locked(tmp_path / "lease.lock"),
    ):
        pass


def _fill_last_page(storage: str) -> None:
    """Append journal entries (studies of no use) until the journal's last page is full too: a full
    filesystem still takes small appends into the free end of a file's last page."""
    journal = make_storage(storage)
    with pytest.raises(DiskFullError):
        for number in range(100_000):
            journal.create_new_study([StudyDirection.MAXIMIZE], study_name=f"padding-{number}")


def _sleeping_job(job_dir: Path) -> JobSpec:
    params = {"x": 0.5, **LONG_TRIAL}
    env = contract_env(JobPaths(job_dir), params=params, data_dir=job_dir.parent, trial="0")
    return JobSpec(
        name="trial-0", entrypoint=FIXTURES / "trainers" / "quadratic.py", job_dir=job_dir, env=env
    )


def _capture(into: dict[str, BaseException | object], call: object) -> None:
    try:
        into["result"] = call()  # type: ignore[operator]
    except BaseException as exc:
        into["error"] = exc


def _stop_all(launcher: LocalLauncher, job_dir: Path) -> None:
    record = read_submission(JobPaths(job_dir))
    if record is not None and record.job_id is not None:
        launcher.attach(record.job_id, job_dir).cancel()


def _stop_jobs(tmp_path: Path, numbers: list[int]) -> None:
    launcher = LocalLauncher(tmp_path / "shared")
    for number in numbers:
        _stop_all(launcher, job_dir(tmp_path, number))
    assert no_process_left(tmp_path, numbers)
