"""MLflow runs made ahead of their trials (``tunepod.tracking.reserve``), on a real MLflow store
(SQLite): a trial takes one without a call to MLflow and its first sync names it; two reserves on
one folder (two orchestrators of one study) never hand out one run twice; a reserve left by a killed
process (a real SIGKILL) is taken over and its runs deleted; a take that crashed before the job dir's
record named the run is finished by the trial's next mirror; what nobody took is deleted at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from mlflow.entities import ViewType

from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import Submission, now_iso, write_submission
from tunepod.tracking import tags
from tunepod.tracking.mirror import RunMirror, RunPlan, read_mirror_state
from tunepod.tracking.mlflow_tracker import MlflowTracker
from tunepod.tracking.reserve import FILLER_THREAD, RESERVE_FOLDER, RunReserve, reserved_run_file

EXPERIMENT = "runs-ahead"
REPO = Path(__file__).resolve().parents[2]


class CountingTracker(MlflowTracker):
    """The real tracker, counting the runs it creates other than a reserve's filler thread's."""

    def __init__(self, uri: str) -> None:
        super().__init__(uri, EXPERIMENT)
        self.created = 0
        self._count_lock = threading.Lock()

    def start_run(self, *args: Any, **kwargs: Any) -> str:
        run_id = super().start_run(*args, **kwargs)
        if threading.current_thread().name != FILLER_THREAD:
            with self._count_lock:
                self.created += 1
        return run_id


@pytest.fixture
def uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def tracker(uri: str) -> CountingTracker:
    return CountingTracker(uri)


@pytest.fixture
def parent(tracker: MlflowTracker) -> str:
    return tracker.start_run("pipeline")


@pytest.fixture
def reserves() -> Iterator[list[RunReserve]]:
    opened: list[RunReserve] = []
    yield opened
    for reserve in opened:
        reserve.close(all_named=False)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def ready(folder: Path) -> list[str]:
    return sorted(name.removesuffix(".run") for name in os.listdir(folder) if name.endswith(".run"))


def trial_plan(number: int, parent: str) -> RunPlan:
    return RunPlan(
        key=f"study/trial-{number}",
        name=f"trial-{number}",
        parent_run_id=parent,
        tags={tags.TRIAL: str(number), tags.STUDY: "study", tags.STATE: "RUNNING"},
        params={"lr": 0.1},
    )


def reserved_runs(uri: str, view: int = ViewType.ACTIVE_ONLY) -> list[Any]:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    return list(client.search_runs([experiment.experiment_id], f"tags.`{tags.RESERVED}` = 'true'", view))


def test_a_trial_takes_a_run_made_ahead_at_once_and_its_first_sync_names_it(
    tmp_path: Path, tracker: CountingTracker, parent: str, reserves: list[RunReserve]
) -> None:
    reserve = RunReserve(tracker, tmp_path / "jobs", parent, size=2)
    reserves.append(reserve)
    wait_for(lambda: len(ready(reserve.folder)) == 2, "two runs made ahead")
    made_ahead, created = ready(reserve.folder), tracker.created

    job_dir = tmp_path / "jobs" / "trial-0"
    job_dir.mkdir()
    mirror = RunMirror(tracker, job_dir, plan=trial_plan(0, parent), reserve=reserve)

    # Known without creating a run, recorded in the job dir.
    assert mirror.run_id in made_ahead and tracker.created == created
    assert read_mirror_state(job_dir).run_id == mirror.run_id
    assert not reserved_run_file(job_dir).exists()
    wait_for(lambda: len(ready(reserve.folder)) == 2, "the reserve made one more")

    record = Submission(backend="local", name="trial-0", attempt=1, submission_id="s1", intent_at=now_iso())
    write_submission(JobPaths(job_dir), record.accepted("4242", {}))
    mirror.sync()
    run = MlflowClient(tracker.tracking_uri).get_run(mirror.run_id or "")
    assert run.info.run_name == "trial-0"
    assert run.data.tags[tags.KEY] == "study/trial-0" and run.data.tags[tags.TRIAL] == "0"
    assert run.data.tags[tags.PARENT_RUN] == parent and run.data.tags[tags.RESERVED] == "false"
    assert run.data.tags["tunepod.job_id"] == "4242" and run.data.params == {"lr": "0.1"}
    assert tracker.find_run("study/trial-0") == mirror.run_id
    assert read_mirror_state(job_dir).named


def test_two_reserves_on_one_folder_never_hand_out_a_run_twice(
    tmp_path: Path, tracker: CountingTracker, parent: str, reserves: list[RunReserve]
) -> None:
    """Two orchestrators of one pipeline run (one reserve each, one folder), 8 threads taking runs
    into their own job dirs as fast as the reserves refill."""
    both = [RunReserve(tracker, tmp_path / "jobs", parent, size=3) for _ in range(2)]
    reserves.extend(both)
    taken: list[str] = []
    lock = threading.Lock()

    def take(worker: int) -> None:
        for n in range(6):
            job_dir = tmp_path / "jobs" / f"w{worker}-{n}"
            job_dir.mkdir()
            deadline = time.monotonic() + 30
            while (run_id := both[worker % 2].take_into(job_dir)) is None:
                assert time.monotonic() < deadline, "no run made ahead in 30 s"
                time.sleep(0.01)
            with lock:
                taken.append(run_id)

    threads = [threading.Thread(target=take, args=(worker,)) for worker in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(taken) == 48 and len(set(taken)) == 48
    client = MlflowClient(tracker.tracking_uri)
    assert all(client.get_run(run_id).data.tags[tags.RESERVED] == "true" for run_id in taken)


def test_a_take_cut_short_before_the_record_named_the_run_is_finished_by_the_next_mirror(
    tmp_path: Path, tracker: CountingTracker, parent: str, reserves: list[RunReserve]
) -> None:
    """Stand-in for an orchestrator killed between the take (the rename) and the record's save: the
    job dir as that kill leaves it (the taken run's file in it, a record naming no run). A mirror
    without a reserve (a rerun with ``runs_ahead: 0``) writes into that run, creating none."""
    reserve = RunReserve(tracker, tmp_path / "jobs", parent, size=1)
    reserves.append(reserve)
    wait_for(lambda: len(ready(reserve.folder)) == 1, "a run made ahead")
    job_dir = tmp_path / "jobs" / "trial-3"
    job_dir.mkdir()
    RunMirror(tracker, job_dir, plan=trial_plan(3, parent))  # the record: no run asked for yet
    left = reserve.take_into(job_dir)
    reserve.close(all_named=False)
    created = tracker.created

    mirror = RunMirror(tracker, job_dir, plan=trial_plan(3, parent))
    mirror.sync()
    assert mirror.run_id == left and tracker.created == created
    assert MlflowClient(tracker.tracking_uri).get_run(left or "").info.run_name == "trial-3"
    assert not reserved_run_file(job_dir).exists()


KILLED_RESERVE = """
import sys, time
from pathlib import Path
from tunepod.tracking.mlflow_tracker import MlflowTracker
from tunepod.tracking.reserve import RunReserve
tracker = MlflowTracker(sys.argv[1], sys.argv[2])
RunReserve(tracker, Path(sys.argv[3]), tracker.start_run("killed pipeline"), size=3)
time.sleep(600)
"""


def test_a_reserve_left_by_a_killed_orchestrator_is_taken_over_and_every_untaken_run_deleted(
    tmp_path: Path, uri: str, tracker: CountingTracker, parent: str
) -> None:
    """Fault: the process holding a reserve of three runs is SIGKILLed (its process group). The next
    reserve beside it deletes those runs and their folder; its own close deletes its untaken runs."""
    jobs = tmp_path / "jobs"
    killed = subprocess.Popen(
        [sys.executable, "-c", KILLED_RESERVE, uri, EXPERIMENT, str(jobs)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True,
    )  # fmt: skip
    folders = jobs / RESERVE_FOLDER
    try:
        wait_for(
            lambda: folders.is_dir() and sum(len(ready(f)) for f in folders.iterdir()) == 3,
            "the first reserve's three runs",
            timeout_s=60,
        )
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    [left] = list(folders.iterdir())
    assert len(reserved_runs(uri)) == 3

    reserve = RunReserve(tracker, jobs, parent, size=2)
    wait_for(lambda: not left.exists() and len(ready(reserve.folder)) == 2, "the left reserve taken over")
    mine = ready(reserve.folder)
    assert sorted(run.info.run_id for run in reserved_runs(uri)) == mine
    reserve.close(all_named=True)
    assert reserved_runs(uri) == [] and ready(reserve.folder) == []
    assert len(reserved_runs(uri, ViewType.DELETED_ONLY)) == 5


def test_close_deletes_a_made_run_no_file_names_only_when_every_taken_run_is_named(
    tmp_path: Path, uri: str, tracker: CountingTracker, parent: str
) -> None:
    """Stand-in for a filler killed between making a run and writing its file: a reserved run of the
    pipeline run that no file names. A taken run not yet named looks the same, so ``close`` deletes
    such runs only when the step's mirrors all caught up, and once they are ``orphan_age_s`` old."""
    orphan = tracker.start_run("reserved", parent_run_id=parent, tags={tags.RESERVED: "true"})
    time.sleep(0.01)
    first = RunReserve(tracker, tmp_path / "jobs", parent, size=1, orphan_age_s=0.0)
    first.close(all_named=False)
    assert orphan in [run.info.run_id for run in reserved_runs(uri)]

    RunReserve(tracker, tmp_path / "jobs", parent, size=1, orphan_age_s=0.0).close(all_named=True)
    assert reserved_runs(uri) == []
    assert orphan in [run.info.run_id for run in reserved_runs(uri, ViewType.DELETED_ONLY)]
