"""Real faults injected into `tunepod run`, run as a user runs it: the CLI as a process of its own, a real
Prefect server, real torchrun jobs (local processes or the real one-node Slurm cluster), a real Optuna
journal and a real MLflow store (SQLite, or a real `mlflow server` that the test kills).

Every test drives the same small pipeline (``faults_support.FaultStudy``: stage a folder, then a study
of 3 trials, 2 at a time, of the quadratic trainer, which appends a line to its job dir's starts.log at
each start) and proves exactly-once behaviour after the fault: exactly num_trials finished trials, each
trained once, one MLflow run per trial with each epoch's metric once, and no job left running.

The `tunepod run` processes share the session's Prefect server (``prefect_api``) through
PREFECT_API_URL: a temporary server per run would cost ~20 s of each run's two-core budget (a fault-free
run measured 55 s with its own server against ~30 s without), and several orchestrators sharing one
server is what a user with `tunepod up` has anyway. A SIGKILLed run leaves its flow run RUNNING there,
which no later run depends on.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
from pathlib import Path

import pytest
from faults_support import (
    FaultStudy,
    MakeRuns,
    Tunepod,
    assert_nothing_left,
    assert_runs_made_ahead_were_taken_or_deleted,
    assert_study_complete,
    assert_tracked_once,
    assert_trained_once,
    queued,
    reported_steps,
    result,
    sqlite_tracking,
    starts,
    study_job_ids,
    study_processes,
    submission,
    wait_for,
)
from local_stack import Stack
from mlflow_server import mlflow_server
from optuna.trial import TrialState
from postgres import fresh_database

from tunepod.launch.local import read_process_stat
from tunepod.launch.paths import JobPaths
from tunepod.runtime import read_reports
from tunepod.runtime.progress import read_progress

pytestmark = pytest.mark.slow

LAUNCHERS = ["local", pytest.param("slurm", marks=pytest.mark.slurm)]
#: How long the MLflow server stays down: well past a request's budget (no retries, 3 s timeout).
MLFLOW_OUTAGE_S = 12.0
MLFLOW_CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "3"}


COLLECTIVE_TRAINER = Path(__file__).resolve().parents[1] / "fixtures" / "trainers" / "collective.py"
#: Heartbeats every 0.5 s, and a loop idle for 4 s counts as hung: the hang is seen within seconds.
HANG_ENV = {"TUNEPOD_HEARTBEAT_S": "0.5"}
HANG_TIMEOUT_S = 4


def hanging_study(tmp_path: Path, max_restarts: int, launcher: str = "local") -> FaultStudy:
    """One trial of the two-rank gloo trainer whose first start hangs in an all-reduce at epoch 2."""
    return FaultStudy(
        tmp_path, launcher, sqlite_tracking(tmp_path), num_trials=1, num_parallel=1, epochs=4, sleep_s=0.2,
        trainer=COLLECTIVE_TRAINER, args={"hang_at_epoch": 2},
        train={
            "resources": {"procs_per_node": 2},
            "hang_timeout_s": HANG_TIMEOUT_S,
            "max_restarts": max_restarts,
        },
    )  # fmt: skip


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_sigkill_of_the_orchestrator_group_mid_study_then_rerun(
    runs: MakeRuns, tmp_path: Path, launcher: str
) -> None:
    """Fault: SIGKILL of the whole `tunepod run` process group (CLI, Prefect, tuner threads, heartbeat)
    while two trials' jobs train, then the same command again.

    Proves: the jobs survive the orchestrator and the rerun re-attaches to them (same job id, first
    attempt, one start each: no trial trained twice), the study ends with exactly num_trials trials,
    MLflow holds one run per trial with every epoch once, and nothing of the study runs afterwards;
    the runs the killed orchestrator made ahead of trials were taken by trials or deleted, and later
    trials' runs were made ahead.
    Epochs of 2 s keep the first jobs running while the rerun starts up (~12 s here), so the rerun
    re-attaches to live jobs (test_a_job_that_finished_while_nobody_watched... covers finished ones).
    """
    # Runs made ahead set on: a SQLite store has none by default.
    study = FaultStudy(tmp_path, launcher, sqlite_tracking(tmp_path), sleep_s=2.0, tracking={"runs_ahead": 2})
    tunepod = runs(study)
    first = tunepod.start("killed")
    wait_for(lambda: len(study.started()) >= 2, "two trials' jobs to start training", running=first)
    first.kill()
    # (A job whose id the killed orchestrator had not recorded yet is adopted by name on the rerun.)
    in_flight = {n: job for n, d in study.started().items() if (job := submission(d).job_id)}

    rerun = tunepod.run("rerun")

    trials = assert_study_complete(study)
    assert_trained_once(study)
    for number, job_id in in_flight.items():
        assert submission(study.job_dir(number)).job_id == job_id, f"trial {number} got a new job"
    assert "re-attaching to unfinished trials" in rerun.output(), rerun.tail()
    assert_tracked_once(study, trials)
    assert assert_runs_made_ahead_were_taken_or_deleted(study) >= 1
    assert_nothing_left(study)


def test_sigkill_of_a_run_the_stack_runner_forked_then_rerun(local_stack: Stack, tmp_path: Path) -> None:
    """Fault: SIGKILL of `tunepod run`'s process group while the local stack's runner runs its flow
    (the orchestrator is then the runner's child, in a session of its own, not in the killed group),
    then the same command again, through the runner too.

    Proves: the runner kills its child when the command dies (as a SIGKILLed in-process run dies with
    its group), the jobs survive it and the rerun re-attaches to them (same job id, first attempt, one
    start each), the study ends with exactly num_trials trials tracked once, nothing of it runs after.
    """
    study = FaultStudy(tmp_path, "local", sqlite_tracking(tmp_path), sleep_s=2.0)
    env = {name: value for name, value in local_stack.env.items() if name != "PREFECT_API_URL"}
    tunepod = Tunepod(study.write(), {**env, "COLUMNS": "200"})
    try:
        first = tunepod.start("killed")
        wait_for(lambda: len(study.started()) >= 2, "two trials' jobs to start training", running=first)
        forked = re.search(r"running in the local stack's runner \(process (\d+)\)", first.output())
        assert forked is not None, first.tail()
        orchestrator = int(forked.group(1))
        first.kill()
        wait_for(lambda: not process_lives(orchestrator), "the runner to kill the orchestrator it forked")
        in_flight = {n: job for n, d in study.started().items() if (job := submission(d).job_id)}

        rerun = tunepod.run("rerun")
    finally:
        tunepod.close()

    assert "running in the local stack's runner" in rerun.output(), rerun.tail()
    assert "re-attaching to unfinished trials" in rerun.output(), rerun.tail()
    trials = assert_study_complete(study)
    assert_trained_once(study)
    for number, job_id in in_flight.items():
        assert submission(study.job_dir(number)).job_id == job_id, f"trial {number} got a new job"
    assert_tracked_once(study, trials)
    assert_nothing_left(study)


def process_lives(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie counts as gone)."""
    stat = read_process_stat(pid)
    return stat is not None and not stat.is_dead


def test_mlflow_server_killed_mid_study_longer_than_the_retry_budget(runs: MakeRuns, tmp_path: Path) -> None:
    """Fault: the MLflow tracking server's process group is SIGKILLed while trials report, stays down for
    12 s (the client's budget is one 3 s attempt), and comes back on the same port and store.

    Proves: the run exits 0 with every trial COMPLETE (an outage never fails, stops or restarts a
    trial), tunepod says so with a warning and no traceback, and once MLflow answers again every trial
    has one run holding each epoch's metric once (reports made during the outage included).
    """
    with mlflow_server(tmp_path / "mlflow-server") as server:
        study = FaultStudy(tmp_path, "local", server.url)
        tunepod = runs(study, **MLFLOW_CLIENT_ENV)
        run = tunepod.start("outage")
        wait_for(lambda: reported_steps(study) > 0, "a trial to report", running=run)

        server.kill()
        before = reported_steps(study)
        down_until = time.monotonic() + MLFLOW_OUTAGE_S
        wait_for(lambda: time.monotonic() > down_until, "the outage to last its time", running=run)
        during = reported_steps(study) - before
        server.start()

        code = run.wait()
        assert code == 0, f"`tunepod run` exited {code} after the MLflow outage\n{run.tail()}"
        assert during > 0, "no trial reported while MLflow was down: the fault missed the study"
        output = run.output()
        assert "MLflow did not take the records of" in output, run.tail()
        assert "MLflow answers again" in output, run.tail()
        assert "Traceback" not in output, run.tail()

        trials = assert_study_complete(study)
        assert_trained_once(study)
        assert_tracked_once(study, trials)
        assert_nothing_left(study)


def test_two_tunepod_runs_on_one_study_at_once(runs: MakeRuns, tmp_path: Path) -> None:
    """Fault: two `tunepod run` processes on the same spec (same study, in a new PostgreSQL database as
    in production; same MLflow store and shared root) started together, as two users, or a cron job
    and a person, would. (Two orchestrators on a journal: tests/integration/test_exactly_once.py.)

    Proves: both exit 0 (both create the study's tables at once on the empty database), the study
    ends with exactly num_trials trials (not one batch per orchestrator), each trial was driven and
    trained once (one start each), never more than num_parallel of them at once (the cap is the
    study's, not each orchestrator's), and MLflow holds one run per trial with every epoch once.
    """
    with fresh_database("two_orchestrators") as database:
        study = FaultStudy(tmp_path, "local", sqlite_tracking(tmp_path), storage_url=database)
        tunepod = runs(study)
        both = [tunepod.start("a"), tunepod.start("b")]
        codes = {o.name: o.wait() for o in both}
        assert codes == {"a": 0, "b": 0}, "\n".join(o.tail() for o in both)
        trials = assert_study_complete(study)
    assert_trained_once(study)
    # Each job from its trainer's start to its result: inside the time its trial was in flight.
    spans = [
        (float((d / "starts.log").read_text().split()[0]), (d / "result.json").stat().st_mtime)
        for d in study.job_dirs().values()
    ]
    running = most = 0
    for _, step in sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans]):
        running += step
        most = max(most, running)
    assert most <= study.num_parallel, sorted(spans)
    assert_tracked_once(study, trials)
    assert_nothing_left(study)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_job_that_finished_while_nobody_watched_is_not_trained_again(
    runs: MakeRuns, tmp_path: Path, launcher: str
) -> None:
    """Fault: SIGKILL of the `tunepod run` process group while trials train; their jobs then finish with
    no orchestrator watching (result.json written, processes gone, the Slurm job out of the queue), and
    only then the same command runs again.

    Proves: the rerun exits 0 and takes those trials as COMPLETE with the value their result.json
    holds, without training them again (one start each) or submitting them again (attempt 1).
    """
    # Two trials, both unwatched when they finish: nothing else is left for the rerun to train.
    study = FaultStudy(tmp_path, launcher, sqlite_tracking(tmp_path), num_trials=2)
    tunepod = runs(study)
    first = tunepod.start("killed")
    wait_for(lambda: len(study.started()) >= 2, "two trials' jobs to start training", running=first)
    first.kill()
    unwatched = study.started()
    job_ids = {n: job for n, d in unwatched.items() if (job := submission(d).job_id)}

    wait_for(
        lambda: all((d / "result.json").exists() for d in unwatched.values()),
        f"trials {sorted(unwatched)} to finish on their own",
    )
    wait_for(lambda: not study_processes(study), "the finished jobs' processes to exit")
    if launcher == "slurm":
        wait_for(lambda: not queued(list(job_ids.values())), f"Slurm jobs {job_ids} to leave the queue")
    written = {n: result(d) for n, d in unwatched.items()}

    tunepod.run("rerun")

    trials = assert_study_complete(study)
    recorded = study_job_ids(study)
    for number, job_dir in unwatched.items():
        assert trials[number].value == pytest.approx(written[number].metrics["score"]), number
        assert starts(job_dir) == 1, f"trial {number} was trained again"
        assert submission(job_dir).attempt == 1, f"trial {number} was submitted again"
        if number in job_ids:
            assert recorded[number] == job_ids[number], f"trial {number} got a new job"
    assert_trained_once(study)
    assert_tracked_once(study, trials)
    assert_nothing_left(study)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_hung_collective_is_stopped_and_the_trial_resumes_from_its_checkpoint(
    runs: MakeRuns, tmp_path: Path, launcher: str
) -> None:
    """Fault: a real hang. Rank 1 of a two-rank gloo job stops joining all-reduces at epoch 2 while
    rank 0 waits in one: both processes live, neither loop advances (``collective.py``). On Slurm the
    job is a real batch job (srun, torchrun) that scancel stops.

    Proves: after ``hang_timeout_s`` without progress tunepod says the job is hung, naming both ranks
    as alive but stuck, stops it and starts attempt 2, which resumes from the epoch-1 checkpoint (each
    epoch reported once, the script started twice), and the trial completes, counted once.
    """
    study = hanging_study(tmp_path, max_restarts=1, launcher=launcher)
    run = runs(study, **HANG_ENV).run("hang")

    trials = assert_study_complete(study)
    assert len(trials) == 1
    job_dir = study.job_dir(0)
    assert starts(job_dir) == 2
    assert submission(job_dir).attempt == 2
    assert [report.step for report in read_reports(JobPaths(job_dir).metrics)] == [0, 1, 2, 3]
    output = run.output()
    assert "is hung, stopping it: no progress for" in output, run.tail()
    assert "(last step 1)" in output and "rank 0 on" in output and "rank 1 on" in output, run.tail()
    assert "alive (stuck in a collective" in output, run.tail()
    assert "hung; restart 1 of 1, resuming from its checkpoints" in output, run.tail()
    assert_nothing_left(study)


def test_a_hung_job_with_no_restart_left_fails_its_trial_with_a_runbook(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault: the same real hang, with ``max_restarts: 0``.

    Proves: the job is stopped (nothing is left running), the trial FAILs, and `tunepod run` exits 1
    with a message that says the trial hung, its last step, which ranks stopped, and the job's logs.
    """
    study = hanging_study(tmp_path, max_restarts=0)
    run = runs(study, **HANG_ENV).start("hang")
    assert run.wait() == 1, run.tail()

    [trial] = study.trials()
    assert trial.state is TrialState.FAIL
    assert starts(study.job_dir(0)) == 1
    output = run.output()
    assert "hung: no progress for" in output and "(last step 1)" in output, run.tail()
    assert "rank 1 on" in output and "Last 20 lines of its log" in output, run.tail()
    assert_nothing_left(study)


def test_a_killed_rank_fails_the_job_in_bounded_time_and_the_trial_resumes(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault: SIGKILL of one rank (rank 1, found through its heartbeat file) of a two-rank gloo job
    while rank 0 trains on.

    Proves: the surviving rank does not wait forever (torchrun or, failing that, hang detection ends
    the job), the job is restarted once from its checkpoint and the trial completes, counted once,
    with every epoch reported; nothing is left running.
    """
    study = hanging_study(tmp_path, max_restarts=1)
    study = dataclasses.replace(study, epochs=6, sleep_s=1.0, args={"hang_at_epoch": -1})
    run = runs(study, **HANG_ENV).start("lost-rank")
    paths = JobPaths(study.job_dir(0))
    wait_for(lambda: reported_steps(study) >= 2, "two epochs reported", running=run)
    rank_1 = next(beat for beat in read_progress(paths.progress) if beat.rank == 1)
    os.kill(rank_1.pid, signal.SIGKILL)
    assert run.wait() == 0, run.tail()

    assert_study_complete(study)
    assert starts(paths.job_dir) == 2
    assert submission(paths.job_dir).attempt == 2
    steps = [report.step for report in read_reports(paths.metrics)]
    assert sorted(set(steps)) == list(range(study.epochs)), steps
    second_start = float((paths.job_dir / "starts.log").read_text().splitlines()[1])
    resumed = [r.step for r in read_reports(paths.metrics) if r.time > second_start]
    assert resumed and resumed[0] > 0, f"attempt 2 started from scratch: {steps}"
    assert "restart 1 of 1, resuming from its checkpoints" in run.output(), run.tail()
    assert_nothing_left(study)
