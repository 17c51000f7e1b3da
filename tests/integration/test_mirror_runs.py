"""A job's MLflow run is created once, on a real MLflow store (SQLite): a new job dir's first sync
creates it without a search; a job dir whose record says nothing of a run (an orchestrator killed
between MLflow's create and the record's save), or a create whose answer was lost, looks the run up
first and writes into it. The trial's params reach the run with its job's tags, or with its final
record when the job never started.

The orchestrator's death is stood in for here (a record left as the killed process leaves it, a
create that raises after MLflow made the run): the kill itself, through ``tunepod run``, is in
tests/e2e/test_faults.py and the chaos soak.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import Submission, now_iso, write_submission
from tunepod.tracking import tags
from tunepod.tracking.mirror import Final, RunMirror, RunPlan, read_mirror_state
from tunepod.tracking.mlflow_tracker import MlflowTracker

KEY = "study/trial-0"


@pytest.fixture
def tracker(tmp_path: Path) -> MlflowTracker:
    return MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "mirror-runs")


def plan() -> RunPlan:
    return RunPlan(key=KEY, name="trial-0", parent_run_id=None, tags={}, params={"lr": 0.1, "depth": 3})


def runs_with_key(tracker: MlflowTracker) -> list[str]:
    return [run.info.run_id for run in tracker.find_runs(f"tags.`{tags.KEY}` = '{KEY}'")]


class CountingTracker(MlflowTracker):
    """The real tracker, counting its searches; ``lose_create_answer``: the first create makes the run
    and then raises, as a request whose answer never came back."""

    def __init__(self, uri: str, *, lose_create_answer: bool = False) -> None:
        super().__init__(uri, "mirror-runs")
        self.searches = 0
        self.lose_create_answer = lose_create_answer

    def find_runs(self, filter_string: str) -> list[object]:
        self.searches += 1
        return super().find_runs(filter_string)

    def start_run(self, *args: object, **kwargs: object) -> str:
        run_id = super().start_run(*args, **kwargs)  # type: ignore[arg-type]
        if self.lose_create_answer:
            self.lose_create_answer = False
            raise ConnectionError("the answer to create_run was lost")
        return run_id


def submitted(job_dir: Path) -> None:
    record = Submission(backend="local", name="trial-0", attempt=1, submission_id="s1", intent_at=now_iso())
    write_submission(JobPaths(job_dir), record.accepted("4242", {}))


def test_a_new_job_dir_creates_its_run_without_a_search(tmp_path: Path) -> None:
    counting = CountingTracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    job_dir = tmp_path / "trial-0"
    job_dir.mkdir()
    mirror = RunMirror(counting, job_dir, plan=plan())
    mirror.sync()
    assert counting.searches == 0
    assert runs_with_key(counting) == [mirror.run_id]


def test_a_record_without_a_run_id_finds_the_run_a_killed_orchestrator_created(
    tmp_path: Path, tracker: MlflowTracker
) -> None:
    job_dir = tmp_path / "trial-0"
    job_dir.mkdir()
    RunMirror(tracker, job_dir, plan=plan())  # wrote the record; then it asked MLflow for the run ...
    asked = read_mirror_state(job_dir).model_copy(update={"run_requested": True})
    JobPaths(job_dir).tracking.write_text(asked.model_dump_json())
    created = tracker.start_run("trial-0", tags={tags.KEY: KEY})
    assert read_mirror_state(job_dir).run_id is None  # ... and the process died before saving its id
    mirror = RunMirror(tracker, job_dir, plan=plan())  # the next orchestrator
    mirror.sync()
    assert mirror.run_id == created
    assert runs_with_key(tracker) == [created]


def test_a_record_of_an_older_version_without_a_run_id_looks_the_run_up(
    tmp_path: Path, tracker: MlflowTracker
) -> None:
    """A record that does not say whether a run was asked for (written before run_requested) may
    belong to a run created by an orchestrator killed before it saved the id."""
    job_dir = tmp_path / "trial-0"
    job_dir.mkdir()
    JobPaths(job_dir).tracking.write_text('{"run_id": null, "synced_step": -1}')
    created = tracker.start_run("trial-0", tags={tags.KEY: KEY})
    mirror = RunMirror(tracker, job_dir, plan=plan())
    mirror.sync()
    assert mirror.run_id == created
    assert runs_with_key(tracker) == [created]


def test_two_mirrors_of_one_job_dir_make_one_run(tmp_path: Path, tracker: MlflowTracker) -> None:
    """Two orchestrators (one of them stale, its lease taken over) mirror one job dir: the second
    syncs while the first one's create is on its way to MLflow (found by the simulation: two runs for
    one trial). It must wait for that create and take its run, not look, find nothing and create."""
    job_dir = tmp_path / "trial-0"
    job_dir.mkdir()
    second = RunMirror(tracker, job_dir, plan=plan())
    meanwhile = threading.Thread(target=second.sync)

    class SlowToCreate(MlflowTracker):
        def start_run(self, *args: Any, **kwargs: Any) -> str:
            meanwhile.start()
            meanwhile.join(timeout=3)  # the other mirror syncs meanwhile, or waits for this create
            return super().start_run(*args, **kwargs)

    slow = SlowToCreate(tracker.tracking_uri, "mirror-runs")
    first = RunMirror(slow, job_dir, plan=plan())
    first.sync()
    meanwhile.join(timeout=30)
    assert not meanwhile.is_alive()
    assert runs_with_key(tracker) == [first.run_id]
    assert second.run_id == first.run_id


def test_a_create_whose_answer_was_lost_is_looked_up_before_creating_again(tmp_path: Path) -> None:
    counting = CountingTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", lose_create_answer=True)
    job_dir = tmp_path / "trial-0"
    job_dir.mkdir()
    mirror = RunMirror(counting, job_dir, plan=plan())
    with pytest.raises(ConnectionError):
        mirror.sync()
    mirror.sync()  # the outbox's retry
    assert counting.searches == 1
    assert runs_with_key(counting) == [mirror.run_id]


def test_params_reach_the_run_with_the_job_tags(tmp_path: Path, tracker: MlflowTracker) -> None:
    job_dir = tmp_path / "trial-0"
    job_dir.mkdir()
    mirror = RunMirror(tracker, job_dir, plan=plan())
    mirror.sync()  # the run, before its job is submitted
    submitted(job_dir)
    mirror.sync()
    run = MlflowClient(tracker.tracking_uri).get_run(str(mirror.run_id))
    assert run.data.params == {"lr": "0.1", "depth": "3"}
    assert run.data.tags[tags.job_tags(tags.PREFIX)[0]] == "4242"


def test_params_reach_the_run_with_the_final_record_when_the_job_never_started(
    tmp_path: Path, tracker: MlflowTracker
) -> None:
    job_dir = tmp_path / "trial-0"
    job_dir.mkdir()
    mirror = RunMirror(tracker, job_dir, plan=plan())
    mirror.finish(Final(tags={tags.STATE: "FAIL"}, status="FAILED", error="the spec's entrypoint is gone"))
    mirror.sync()
    run = MlflowClient(tracker.tracking_uri).get_run(str(mirror.run_id))
    assert run.data.params == {"lr": "0.1", "depth": "3"}
    assert run.info.status == "FAILED"


def test_params_logged_again_after_a_restart_are_no_change(tmp_path: Path, tracker: MlflowTracker) -> None:
    job_dir = tmp_path / "trial-0"
    job_dir.mkdir()
    submitted(job_dir)
    first = RunMirror(tracker, job_dir, plan=plan())
    first.sync()
    again = RunMirror(tracker, job_dir, plan=plan())  # a restarted orchestrator: params once more
    again.sync()
    assert again.run_id == first.run_id
    run = MlflowClient(tracker.tracking_uri).get_run(str(again.run_id))
    assert run.data.params == {"lr": "0.1", "depth": "3"}


def test_more_params_and_tags_than_one_batch_takes_all_reach_the_run(tracker: MlflowTracker) -> None:
    """MLflow takes at most 100 params and 100 tags per write: a trial with more is split, not refused."""
    run_id = tracker.start_run("wide")
    params = {f"p{n}": n for n in range(150)}
    tracker.set_tags(run_id, {f"t{n}": n for n in range(120)}, params=params)
    run = MlflowClient(tracker.tracking_uri).get_run(run_id)
    assert run.data.params == {key: str(value) for key, value in params.items()}
    assert {f"t{n}" for n in range(120)} <= set(run.data.tags)
