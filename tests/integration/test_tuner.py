"""The tuning loop against real components: torchrun jobs on the local launcher, a journal (or SQLite)
Optuna storage, and an MLflow SQLite store. Prefect is not involved here (see tests/e2e)."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow import MlflowClient
from sshd import TARGET, ssh_options

from tunepod.errors import JobError
from tunepod.hpo.tuner import ATTR_JOB_ID, TuneContext, Tuner, require_completed
from tunepod.launch.base import Launcher
from tunepod.launch.local import LocalLauncher
from tunepod.launch.paths import JobPaths
from tunepod.launch.slurm import SlurmLauncher
from tunepod.launch.submission import read_submission
from tunepod.outputs import Dataset, TrialRecord, TrialSet
from tunepod.runtime import Report, latest_checkpoint, read_reports
from tunepod.runtime.progress import HEARTBEAT_S_ENV
from tunepod.spec.models import SlurmLauncherSpec, TuneSettings
from tunepod.tracking import MlflowTracker
from tunepod.tracking.outbox import TrackingOutbox

PIPELINE = "tuner-tests"
TRAINER = Path(__file__).resolve().parents[1] / "fixtures" / "trainers" / "quadratic.py"


def settings(tmp_path: Path, **overrides: Any) -> TuneSettings:
    raw: dict[str, Any] = {
        "train": {"entrypoint": str(TRAINER), "args": {"epochs": 3}},
        "study": {"name": "quad", "storage": f"journal://{tmp_path}/optuna.log", "metric": "score"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "num_trials": 4,
        "num_parallel": 2,
        "sampler": "random",
        "seed": 1,
        "poll_s": 0.2,
    }
    for key, value in overrides.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and key in raw else value
    return TuneSettings.model_validate(raw)


def make_launcher(kind: str, root: Path) -> Launcher:
    """``local``, ``slurm`` (the local cluster), or ``slurm-ssh`` (the same, every command over ssh)."""
    if kind.startswith("slurm"):
        over_ssh = {"ssh": TARGET, "ssh_options": ssh_options()} if kind == "slurm-ssh" else {}
        spec = SlurmLauncherSpec.model_validate(
            {
                "kind": "slurm",
                "root": str(root),
                "python": sys.executable,
                "poll_cache_s": 0.2,
                # Beats as often as the trainer reports, so that a short hang_timeout_s is safe.
                "env": {HEARTBEAT_S_ENV: "0.5"},
                **over_ssh,
            }
        )
        return SlurmLauncher(spec)
    return LocalLauncher(root, cancel_grace_s=5)


def make_tuner(tmp_path: Path, tune: TuneSettings, launcher: str | Launcher = "local") -> Tuner:
    tracker = MlflowTracker(f"sqlite:///{tmp_path}/mlflow.db", "tests")
    parent = tracker.start_run("pipeline")
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    dataset = Dataset(source="test", path=str(data), num_files=0, num_bytes=0, copied_files=0, copied_bytes=0)
    return Tuner(
        TuneContext(
            step="search",
            settings=tune,
            launcher=make_launcher(launcher, tmp_path / "shared") if isinstance(launcher, str) else launcher,
            dataset=dataset,
            jobs_dir=tmp_path / "shared" / "jobs" / tune.study.name,
            tracker=tracker,
            outbox=TrackingOutbox(),
            parent_run_id=parent,
            pipeline=PIPELINE,
        )
    )


def run_together(*tuners: Tuner) -> list[TrialSet]:
    """Each tuner's ``run()`` on a thread of its own, all started at once (two orchestrators on one
    study); their trial sets, in order."""
    barrier = threading.Barrier(len(tuners))

    def run(tuner: Tuner) -> TrialSet:
        barrier.wait()
        return tuner.run()

    with ThreadPoolExecutor(len(tuners)) as pool:
        return list(pool.map(run, tuners))


def child_runs(tmp_path: Path, parent_run_id: str) -> list[Any]:
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("tests")
    return list(
        client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'")
    )


def wait_for_checkpoint(tuner: Tuner, running: Future[TrialSet], step: int) -> int:
    """Wait until trial 0 of a running study has checkpointed ``step``; the newest step seen."""
    checkpoints = tuner.ctx.jobs_dir / "trial-0" / "checkpoints"
    while (info := latest_checkpoint(checkpoints)) is None or info.step < step:
        assert not running.done(), running.exception()
        time.sleep(0.1)
    return info.step


def wait_for_report(tuner: Tuner, running: Future[TrialSet], step: int) -> None:
    """Wait until trial 0 of a running study has reported ``step``."""
    metrics = tuner.ctx.jobs_dir / "trial-0" / "metrics.jsonl"
    while not any(report.step >= step for report in read_reports(metrics)):
        assert not running.done(), running.exception()
        time.sleep(0.1)


def stops(job_dir: str) -> list[int]:
    """The epochs at which the trainer saved and exited on a stop signal (its stops.log)."""
    path = Path(job_dir) / "stops.log"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


# The trainer checkpoints only when asked to stop: where it resumes shows that it saved at the signal.
SAVES_ONLY_ON_STOP = {"epochs": 8, "sleep_s": 0.5, "checkpoint_every": 1000}


def reports_after_restart(trial: TrialRecord) -> list[Report]:
    """What the trial's script reported after its second start (starts.log has one line per start)."""
    restarted_at = float(Path(trial.job_dir, "starts.log").read_text().split()[1])
    return [r for r in read_reports(Path(trial.job_dir, "metrics.jsonl")) if r.time > restarted_at]


def starts(job_dir: str) -> int:
    return len((Path(job_dir) / "starts.log").read_text().splitlines())


def test_runs_all_trials_in_parallel_and_tracks_each(tmp_path: Path) -> None:
    tuner = make_tuner(tmp_path, settings(tmp_path, train={"args": {"epochs": 3, "sleep_s": 0.5}}))
    trials = tuner.run()

    assert [t.number for t in trials.trials] == [0, 1, 2, 3]
    assert all(t.outcome == "COMPLETE" for t in trials.trials)
    # Two jobs were in flight together: some trial started before an earlier one had finished.
    windows = sorted(
        (
            float(Path(t.job_dir, "starts.log").read_text().split()[0]),
            Path(t.job_dir, "result.json").stat().st_mtime,
        )
        for t in trials.trials
    )
    assert any(later[0] < earlier[1] for earlier, later in itertools.pairwise(windows))
    runs = child_runs(tmp_path, tuner.ctx.parent_run_id)
    assert len(runs) == 4
    for run in runs:
        assert run.data.tags["tunepod.state"] == "COMPLETE"
        assert run.data.tags["tunepod.checkpoints"].startswith("file://")
        assert "/checkpoints/step-" in run.data.tags["tunepod.checkpoints"]
        assert run.data.tags["tunepod.job_id"].startswith("local-")
        assert "x" in run.data.params
        assert run.info.status == "FINISHED"
    history = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_metric_history(runs[0].info.run_id, "score")
    assert {m.step for m in history} == {0, 1, 2}
    assert [m.step for m in history].count(0) == 1  # the final value lands on the last step, not on 0
    best = trials.best(1)[0]
    assert best.model_id is not None
    assert best.value == max(t.value for t in trials.trials if t.value is not None)


def test_the_trial_set_of_trials_it_ended_is_read_from_memory_and_agrees_with_the_job_dirs(
    tmp_path: Path,
) -> None:
    """At the study's end the orchestrator that ended the trials takes their jobs, runs and models
    from memory, not from two files per trial; a later orchestrator reads the same from the files."""
    tune = settings(tmp_path)
    tuner = make_tuner(tmp_path, tune)
    ended_here = tuner.run()
    assert all(t.run_id and t.model_id and t.job_id for t in ended_here.trials if t.outcome == "COMPLETE")
    read_back = make_tuner(tmp_path, tune).trial_set()
    assert read_back == ended_here

    aside = tmp_path / "aside"
    aside.mkdir()
    for trial in ended_here.trials:
        paths = JobPaths(Path(trial.job_dir))
        for record in (paths.tracking, paths.submission):
            record.rename(aside / f"{trial.number}-{record.name}")
    assert tuner.trial_set() == ended_here
    assert make_tuner(tmp_path, tune).trial_set() != ended_here  # the files are what a rerun reads


def test_rerun_resumes_the_study_and_runs_nothing_twice(tmp_path: Path) -> None:
    first = make_tuner(tmp_path, settings(tmp_path, num_trials=2)).run()
    second = make_tuner(tmp_path, settings(tmp_path, num_trials=3)).run()

    assert [t.number for t in first.trials] == [0, 1]
    assert [t.number for t in second.trials] == [0, 1, 2]
    assert [starts(t.job_dir) for t in second.trials] == [1, 1, 1]
    assert second.trials[0].run_id == first.trials[0].run_id


def test_a_study_started_afresh_under_its_old_name_gets_runs_of_its_own(tmp_path: Path) -> None:
    """The user deletes the Optuna storage to start over, keeping MLflow and the shared root: the new
    trials are new MLflow runs, and the old study's runs keep what they recorded."""
    first = make_tuner(tmp_path, settings(tmp_path, num_trials=2)).run()
    (tmp_path / "optuna.log").unlink()
    second = make_tuner(tmp_path, settings(tmp_path, num_trials=2, seed=7)).run()

    old = {t.number: t for t in first.trials}
    new = {t.number: t for t in second.trials}
    assert set(old) == set(new) == {0, 1}
    assert not {t.run_id for t in old.values()} & {t.run_id for t in new.values()}
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for number, trial in old.items():
        run = client.get_run(str(trial.run_id))
        assert run.data.params["x"] == str(trial.params["x"]) != str(new[number].params["x"])
        assert run.data.metrics["score"] == trial.value
        assert run.info.status == "FINISHED"


@pytest.mark.parametrize("launcher", ["local", pytest.param("slurm", marks=pytest.mark.slurm)])
def test_bad_trials_are_pruned_and_their_jobs_cancelled(tmp_path: Path, launcher: str) -> None:
    tune = settings(
        tmp_path,
        train={"args": {"epochs": 6, "sleep_s": 0.4}},
        num_trials=4,
        num_parallel=2,
        pruner={"kind": "median", "warmup_steps": 1},
        space={"x": {"type": "categorical", "choices": [0.3, 3.0]}},
        sampler="random",
        seed=3,
    )
    tuner = make_tuner(tmp_path, tune, launcher)
    for x in (0.3, 0.3, 3.0, 3.0):  # two good trials set the median the bad ones fall below
        tuner.study.enqueue_trial({"x": x})
    trials = tuner.run()

    pruned = [t for t in trials.trials if t.outcome == "PRUNED"]
    assert pruned, [(t.number, t.params, t.outcome) for t in trials.trials]
    for trial in pruned:
        assert trial.params["x"] == 3.0
        assert Path(trial.job_dir, "cancelled").exists()
        assert not Path(trial.job_dir, "result.json").exists()
        assert (trial.last_step or 0) < 5
    runs = {r.data.tags["tunepod.trial"]: r for r in child_runs(tmp_path, tuner.ctx.parent_run_id)}
    for trial in pruned:
        assert runs[str(trial.number)].data.tags["tunepod.state"] == "PRUNED"
        assert runs[str(trial.number)].info.status == "KILLED"
    frozen = {t.number: t for t in tuner.study.get_trials()}
    assert all(frozen[t.number].state == optuna.trial.TrialState.PRUNED for t in pruned)
    assert_no_job_left(trials.trials, launcher)


@pytest.mark.slurm
def test_a_stop_slower_than_the_cancel_timeout_is_retried_and_the_trial_told_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Real fault on the local Slurm cluster: the bad trials are pruned, and each pruned job takes
    seconds to end after its scancel (the trainer sleeps out its epoch before it saves and exits;
    Slurm holds the job COMPLETING meanwhile), longer than the launcher's ``cancel_timeout_s`` of
    0.5 s. The study must not fail: each trial's driver sends its stop again on later polls until the
    job has ended, and each pruned trial is told to Optuna once, as PRUNED, only then."""
    caplog.set_level(logging.WARNING, logger="tunepod.launch.drive")
    tune = settings(
        tmp_path,
        train={"args": {"epochs": 6, "sleep_s": 2.0}},
        num_trials=4,
        num_parallel=2,
        pruner={"kind": "median", "warmup_steps": 1},
        space={"x": {"type": "categorical", "choices": [0.3, 3.0]}},
    )
    slurm = make_launcher("slurm", tmp_path / "shared")
    assert isinstance(slurm, SlurmLauncher)
    tuner = make_tuner(tmp_path, tune, SlurmLauncher(slurm.spec, cancel_timeout_s=0.5))
    for x in (0.3, 0.3, 3.0, 3.0):  # two good trials set the median the bad ones fall below
        tuner.study.enqueue_trial({"x": x})

    trials = tuner.run()

    outcomes = {t.number: t.outcome for t in trials.trials}
    assert outcomes == {0: "COMPLETE", 1: "COMPLETE", 2: "PRUNED", 3: "PRUNED"}
    frozen = {t.number: t for t in tuner.study.get_trials()}
    assert len(frozen) == 4
    assert [frozen[n].state for n in (2, 3)] == [optuna.trial.TrialState.PRUNED] * 2
    unfinished = [r.getMessage() for r in caplog.records if "has not ended" in r.getMessage()]
    for trial in trials.trials[2:]:
        # The fault happened: the first stop ran out of time, and the warning names trial and job.
        assert any(f"Trial {trial.number} " in m and f"job {trial.job_id} " in m for m in unfinished)
        assert starts(trial.job_dir) == 1 and len(stops(trial.job_dir)) == 1  # stopped once, saved once
    assert_no_job_left(trials.trials, "slurm")


def test_a_failing_trial_is_recorded_with_its_log_tail(tmp_path: Path) -> None:
    tune = settings(
        tmp_path,
        num_trials=3,
        train={"args": {"epochs": 2, "fail_if_x_above": 0.5}, "max_restarts": 0},
        sampler="random",
    )
    tuner = make_tuner(tmp_path, tune)
    tuner.study.enqueue_trial({"x": 0.9})
    trials = tuner.run()

    failed = trials.trials[0]
    assert failed.outcome == "FAIL"
    assert failed.error is not None
    assert "x=0.9 is above fail_if_x_above" in failed.error
    assert "ended FAILED" in failed.error and "stderr.log" in failed.error
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(failed.run_id or "")
    assert run.data.tags["tunepod.state"] == "FAIL"
    assert run.info.status == "FAILED"


def test_no_completed_trial_fails_the_step_with_the_first_error(tmp_path: Path) -> None:
    tune = settings(tmp_path, num_trials=2, train={"args": {"fail_if_x_above": -1.0}, "max_restarts": 0})
    trials = make_tuner(tmp_path, tune).run()
    with pytest.raises(JobError, match="none of 2 trials completed") as raised:
        require_completed(trials)
    assert "fail_if_x_above" in str(raised.value)


def test_sqlite_storage_works_too(tmp_path: Path) -> None:
    tune = settings(tmp_path, num_trials=2, study={"storage": f"sqlite:///{tmp_path}/optuna.db"})
    trials = make_tuner(tmp_path, tune).run()
    assert [t.outcome for t in trials.trials] == ["COMPLETE", "COMPLETE"]
    assert optuna.load_study(study_name="quad", storage=f"sqlite:///{tmp_path}/optuna.db").best_trial


def assert_no_job_left(trials: list[TrialRecord], launcher: str) -> None:
    """Nothing of the study still runs: no Slurm job in the queue, no local process."""
    if launcher == "slurm":
        ids = ",".join(t.job_id or "" for t in trials)
        assert (
            subprocess.run(["squeue", "-h", "-j", ids], capture_output=True, text=True).stdout.strip() == ""
        )
    else:
        local = LocalLauncher(Path("/unused"))
        assert all(local.attach(t.job_id or "", Path(t.job_dir)).pids() == [] for t in trials)


def test_a_killed_trial_job_restarts_and_resumes_from_its_last_checkpoint(tmp_path: Path) -> None:
    """SIGKILL every process of a running trial: with max_restarts the trial's job starts again in
    place and the training script resumes after its last checkpoint."""
    tune = settings(
        tmp_path,
        num_trials=1,
        num_parallel=1,
        train={"args": {"epochs": 6, "sleep_s": 0.5}, "max_restarts": 1},
    )
    tuner = make_tuner(tmp_path, tune)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(tuner.run)
        killed_after = wait_for_checkpoint(tuner, running, step=1)
        job_id = tuner.study.trials[0].user_attrs[ATTR_JOB_ID]
        job = tuner.ctx.launcher.attach(job_id, tuner.ctx.jobs_dir / "trial-0")
        for pid in job.pids():
            os.kill(pid, signal.SIGKILL)
        trials = running.result(timeout=120)

    trial = trials.trials[0]
    assert trial.outcome == "COMPLETE"
    resumed = reports_after_restart(trial)
    # It may have checkpointed once more between our look and the kill, never less.
    assert resumed[0].step in (killed_after + 1, killed_after + 2)
    assert resumed[-1].step == 5
    record = read_submission(JobPaths(Path(trial.job_dir)))
    assert record is not None and record.attempt == 2  # one restart, counted in the job dir


def test_a_preempted_trial_saves_at_the_signal_and_resumes_from_there(tmp_path: Path) -> None:
    """SIGTERM from outside tunepod (a host shutting down, a spot reclaim) to every process of a running
    trial: the script sees ctx.should_stop(), checkpoints the epoch it is at and exits; the job starts
    again once and resumes right after that epoch; Optuna and MLflow hold the trial once."""
    tune = settings(tmp_path, num_trials=1, num_parallel=1, train={"args": SAVES_ONLY_ON_STOP})
    tuner = make_tuner(tmp_path, tune)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(tuner.run)
        wait_for_report(tuner, running, step=1)
        job_id = tuner.study.trials[0].user_attrs[ATTR_JOB_ID]
        job = tuner.ctx.launcher.attach(job_id, tuner.ctx.jobs_dir / "trial-0")
        for pid in job.pids():
            os.kill(pid, signal.SIGTERM)
        trials = running.result(timeout=120)

    (trial,) = trials.trials
    assert trial.outcome == "COMPLETE"
    (stopped_at,) = stops(trial.job_dir)
    assert stopped_at >= 1
    assert reports_after_restart(trial)[0].step == stopped_at + 1
    record = read_submission(JobPaths(Path(trial.job_dir)))
    assert record is not None and record.attempt == 2
    assert len(tuner.study.trials) == 1
    assert len(child_runs(tmp_path, tuner.ctx.parent_run_id)) == 1


@pytest.mark.slurm
def test_a_requeued_trial_saves_at_the_signal_resumes_and_is_counted_once(tmp_path: Path) -> None:
    """scontrol requeue (what a node failure or a preemption does) a running trial: Slurm sends SIGTERM,
    the script checkpoints where it is and exits inside KillWait, Slurm runs the same job again, the
    script resumes right after that checkpoint, and Optuna and MLflow hold the trial once. The job
    waits queued longer than hang_timeout_s: the last run's heartbeats must not make it look hung."""
    train = {"args": SAVES_ONLY_ON_STOP, "hang_timeout_s": 8}
    tuner = make_tuner(tmp_path, settings(tmp_path, num_trials=1, num_parallel=1, train=train), "slurm")
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(tuner.run)
        wait_for_report(tuner, running, step=1)
        job_id = tuner.study.trials[0].user_attrs[ATTR_JOB_ID]
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        trials = running.result(timeout=180)

    (trial,) = trials.trials
    assert trial.outcome == "COMPLETE" and trial.job_id == job_id
    (stopped_at,) = stops(trial.job_dir)
    assert reports_after_restart(trial)[0].step == stopped_at + 1
    record = read_submission(JobPaths(Path(trial.job_dir)))
    assert record is not None and record.attempt == 1  # Slurm ran it again, not tunepod
    assert len(tuner.study.trials) == 1
    assert len(child_runs(tmp_path, tuner.ctx.parent_run_id)) == 1
    assert subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip() == ""


def test_a_sampled_layout_that_does_not_fit_is_pruned_without_a_job(tmp_path: Path) -> None:
    # Each value fits some layout of 1 node x 2 procs, but tensor 2 x pipeline 2 = 4 processes does not.
    space = {
        "x": {"type": "float", "low": 0.0, "high": 1.0},
        "parallelism.tensor": {"type": "categorical", "choices": [1, 2]},
        "parallelism.pipeline": {"type": "categorical", "choices": [1, 2]},
    }
    train = {"resources": {"num_nodes": 1, "procs_per_node": 2}}
    tuner = make_tuner(tmp_path, settings(tmp_path, num_trials=1, space=space, train=train))
    tuner.study.enqueue_trial({"x": 0.5, "parallelism.tensor": 2, "parallelism.pipeline": 2})
    [trial] = tuner.run().trials

    assert trial.outcome == "PRUNED"
    assert trial.error is not None
    assert "tensor 2 x pipeline 2 = 4 does not divide the 2 processes" in trial.error
    assert trial.job_id is None and not JobPaths(Path(trial.job_dir)).submission.exists()
    [run] = child_runs(tmp_path, tuner.ctx.parent_run_id)
    assert run.data.tags["tunepod.state"] == "PRUNED"
    assert run.data.params["parallelism.tensor"] == "2"  # the layout it tried is on record
