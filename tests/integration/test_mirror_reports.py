"""Every line of a job's metrics file reaches its MLflow run exactly once, on a real MLflow store
(SQLite): two reports at one step with a sync between them, a final objective at a step the job
reported twice, syncs cut short by MLflow errors and retried, an orchestrator restarted (a new
``RunMirror`` over the same job dir) after partial syncs or between a batch and its save, and a job
dir whose ``mlflow.json`` a tunepod before ``synced_offset`` wrote.

And a metric MLflow refuses: its points are set aside and named (a tag, ``mlflow.json``), the rest
of the job's records land, and the outbox's ``flush`` returns instead of retrying that run forever;
an MLflow that does not answer, or a deleted run, is still retried.

And the restores of a job with checkpoint tiers: tagged on its run (latest tier and step, every
restore listed), the same after a restart.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE as LOCKED

from tunepod.launch.paths import JobPaths
from tunepod.runtime import read_reports
from tunepod.runtime.metrics import append_report
from tunepod.runtime.restores import Restore, record_restore
from tunepod.runtime.worlds import record_world
from tunepod.tracking import mirror as mirror_module
from tunepod.tracking import tags
from tunepod.tracking.mirror import (
    Final,
    RunMirror,
    RunPlan,
    read_mirror_state,
    report_points,
    restore_tags,
)
from tunepod.tracking.mlflow_tracker import MetricPoint, MlflowTracker, Point
from tunepod.tracking.outbox import TrackingOutbox

Seen = tuple[str, float, int]
"""(key, value, step)."""


@pytest.fixture
def tracker(tmp_path: Path) -> MlflowTracker:
    return MlflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "mirror-reports")


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "trial-0"
    folder.mkdir()
    return folder


def report(job_dir: Path, step: int, **metrics: float) -> None:
    append_report(JobPaths(job_dir).metrics, step, metrics)


def write_line(job_dir: Path, step: int, metrics: dict[str, float]) -> None:
    """A line the runtime no longer writes (a job on an older runtime, or writing the file itself)."""
    line = json.dumps({"step": step, "metrics": metrics, "time": time.time()})
    with open(JobPaths(job_dir).metrics, "a") as handle:
        handle.write(line + "\n")


def reported(job_dir: Path) -> Counter[Seen]:
    """Every point of every line of the metrics file, as often as the lines hold it."""
    lines = JobPaths(job_dir).metrics.read_text().splitlines()
    return Counter(
        (key, float(value), json.loads(line)["step"])
        for line in lines
        for key, value in json.loads(line)["metrics"].items()
    )


def logged(tracker: MlflowTracker, run_id: str) -> Counter[Seen]:
    """Every point of every metric of the run, as often as MLflow holds it."""
    client = MlflowClient(tracker.tracking_uri)
    keys = client.get_run(run_id).data.metrics
    return Counter(
        (key, point.value, point.step) for key in keys for point in client.get_metric_history(run_id, key)
    )


def trial_mirror(tracker: MlflowTracker, job_dir: Path) -> RunMirror:
    plan = RunPlan(key="study/trial-0", name="trial-0", parent_run_id=None, tags={}, params={})
    return RunMirror(tracker, job_dir, plan=plan, mirror_telemetry=False)


def objective(value: float, step: int) -> Final:
    point = Point("score", value, step, timestamp_ms=int(time.time() * 1000))
    return Final(tags={tags.STATE: "COMPLETE"}, status="FINISHED", metrics=(point,))


class FailingTracker(MlflowTracker):
    """The real tracker, whose writes of points numbered in ``fail_calls`` (from 1) raise what a locked
    SQLite file makes MLflow raise (measured: after some 20 s of retries, too slow to wait)."""

    def __init__(self, uri: str, fail_calls: set[int]) -> None:
        super().__init__(uri, "mirror-reports")
        self.fail_calls = fail_calls
        self.calls = 0

    def log_batch(
        self,
        run_id: str,
        points: Sequence[MetricPoint],
        tags: Mapping[str, object],
        *,
        params: Mapping[str, object] | None = None,
    ) -> None:
        if points:
            self.calls += 1
            if self.calls in self.fail_calls:
                raise MlflowException("(sqlite3.OperationalError) database is locked", LOCKED)
        super().log_batch(run_id, points, tags, params=params)


class PointCountingTracker(MlflowTracker):
    """The real tracker, counting the points it is asked to log."""

    points = 0

    def log_batch(
        self,
        run_id: str,
        points: Sequence[MetricPoint],
        tags: Mapping[str, object],
        *,
        params: Mapping[str, object] | None = None,
    ) -> None:
        self.points += len(points)
        super().log_batch(run_id, points, tags, params=params)


# ------------------------------------------------------------------------------ every line, once


def test_two_reports_at_one_step_with_a_sync_between_both_reach_the_run(
    tracker: MlflowTracker, job_dir: Path
) -> None:
    mirror = trial_mirror(tracker, job_dir)
    report(job_dir, 5, score=0.5)
    mirror.sync()
    report(job_dir, 5, loss=1.25)  # another metric at the step just mirrored
    report(job_dir, 5, score=0.55)  # the same metric again: a second point at step 5
    mirror.sync()
    assert mirror.run_id is not None
    assert logged(tracker, mirror.run_id) == Counter(
        {("score", 0.5, 5): 1, ("loss", 1.25, 5): 1, ("score", 0.55, 5): 1}
    )


def test_a_final_objective_equal_to_a_same_step_point_not_yet_logged_is_logged_once(
    tracker: MlflowTracker, job_dir: Path
) -> None:
    mirror = trial_mirror(tracker, job_dir)
    report(job_dir, 5, score=0.5)
    mirror.sync()
    report(job_dir, 5, score=0.6)  # the job's last point, not yet in the run ...
    mirror.finish(objective(0.6, 5))  # ... and the trial's objective is that very point
    mirror.sync()
    assert mirror.is_done and mirror.run_id is not None
    assert logged(tracker, mirror.run_id) == Counter({("score", 0.5, 5): 1, ("score", 0.6, 5): 1})


def test_retries_and_restarts_after_partial_syncs_log_every_line_once(
    tmp_path: Path, job_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mirror_module, "REPORTS_PER_BATCH", 2)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = trial_mirror(FailingTracker(uri, fail_calls={2}), job_dir)
    for step, score in enumerate([0.1, 0.2, 0.3, 0.4, 0.5]):
        report(job_dir, step, score=score)
    with pytest.raises(MlflowException):
        first.sync()  # the first batch is in (and saved so), the second fails
    first.sync()  # the outbox's retry
    report(job_dir, 4, score=0.45)  # a resumed job redoes step 4: a new line, a new point
    report(job_dir, 4, accuracy=0.7)
    before_crash = JobPaths(job_dir).tracking.read_bytes()
    first.sync()  # logs the two lines ...
    JobPaths(job_dir).tracking.write_bytes(before_crash)  # ... and dies before it saves so

    again = trial_mirror(MlflowTracker(uri, "mirror-reports"), job_dir)  # the restarted orchestrator
    report(job_dir, 5, score=0.6)
    again.sync()  # the two lines again (the same points), and the new one
    again.finish(objective(0.6, 5))
    again.sync()

    assert again.run_id == first.run_id and again.run_id is not None
    assert logged(again.tracker, again.run_id) == reported(job_dir)
    assert read_mirror_state(job_dir).synced_offset == JobPaths(job_dir).metrics.stat().st_size


def test_a_restart_after_partial_syncs_logs_nothing_twice_and_loses_nothing(
    tracker: MlflowTracker, job_dir: Path
) -> None:
    first = trial_mirror(tracker, job_dir)
    report(job_dir, 0, score=0.1)
    report(job_dir, 1, score=0.2)
    first.sync()
    report(job_dir, 1, loss=0.9)  # the same step as the last one mirrored
    first.sync()
    report(job_dir, 1, score=0.25)  # written while no orchestrator runs

    again = trial_mirror(tracker, job_dir)
    again.sync()
    report(job_dir, 2, score=0.3)
    again.finish(objective(0.3, 2))
    again.sync()

    assert again.run_id == first.run_id and again.run_id is not None
    assert logged(tracker, again.run_id) == reported(job_dir)


def test_a_job_dir_of_the_previous_version_carries_on_without_logging_everything_again(
    tracker: MlflowTracker, job_dir: Path
) -> None:
    """The previous version kept only ``synced_step``, and dropped a report at a step it had mirrored."""
    run_id = tracker.start_run("trial-0", tags={tags.KEY: "study/trial-0"})
    report(job_dir, 0, score=0.1)
    report(job_dir, 1, score=0.2)
    # That version logged these, and saved:
    tracker.log_batch(run_id, report_points(read_reports(JobPaths(job_dir).metrics)), {})
    legacy = {"run_id": run_id, "synced_step": 1, "model_id": None, "finalized": False}
    JobPaths(job_dir).tracking.write_text(json.dumps(legacy))
    report(job_dir, 1, loss=0.9)  # it would have dropped these two (step <= 1) ...
    report(job_dir, 1, score=0.25)
    report(job_dir, 2, score=0.3)  # ... and logged this one

    counting = PointCountingTracker(tracker.tracking_uri, "mirror-reports")
    upgraded = trial_mirror(counting, job_dir)
    upgraded.finish(objective(0.3, 2))
    upgraded.sync()

    assert upgraded.run_id == run_id
    assert logged(tracker, run_id) == reported(job_dir)
    assert counting.points == 3  # the lines after the last one that version logged, no more
    assert read_mirror_state(job_dir).synced_offset == JobPaths(job_dir).metrics.stat().st_size


# ------------------------------------------------------------------------------ refused by MLflow


def test_an_outbox_is_not_stuck_behind_a_metric_name_mlflow_refuses(
    tracker: MlflowTracker, job_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_line(job_dir, 0, {"acc@1": 0.5})  # '@': MLflow refuses the name, on every try
    write_line(job_dir, 1, {"acc@1": 0.6, "score": 0.2})  # a good metric beside it
    report(job_dir, 2, score=0.3)
    mirror = trial_mirror(tracker, job_dir)
    mirror.finish(objective(0.3, 2))
    outbox = TrackingOutbox(max_backoff_s=0.05, threads=1)
    try:
        outbox.add(mirror)
        with caplog.at_level(logging.WARNING, logger=mirror_module.__name__):
            # Short: the old code retried this run forever, and this flush waited it out.
            assert outbox.flush(timeout_s=10)
    finally:
        outbox.close()

    assert mirror.is_done and mirror.run_id is not None
    assert logged(tracker, mirror.run_id) == Counter({("score", 0.2, 1): 1, ("score", 0.3, 2): 1})
    run = MlflowClient(tracker.tracking_uri).get_run(mirror.run_id)
    assert run.info.status == "FINISHED" and run.data.tags[tags.STATE] == "COMPLETE"
    assert json.loads(run.data.tags[tags.PREFIX + tags.REFUSED_METRICS]) == ["acc@1"]
    assert read_mirror_state(job_dir).refused_metrics == ("acc@1",)
    warnings = [r.getMessage() for r in caplog.records if "acc@1" in r.getMessage()]
    assert len(warnings) == 1 and "set aside" in warnings[0]


def test_a_refusal_the_mirror_did_not_foresee_is_narrowed_down_to_the_points_mlflow_refuses(
    tracker: MlflowTracker, job_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As a tracking server whose rules are stricter than the mirror's own check: MLflow's answer."""
    monkeypatch.setattr(mirror_module, "_name_problem", lambda name: None)  # the mirror checks nothing
    for step in range(3):
        report(job_dir, step, score=0.1 * step, loss=1.0 - step / 10)
    write_line(job_dir, 3, {"score": 0.4, "top(5)": 0.9})
    report(job_dir, 4, score=0.5)
    mirror = trial_mirror(tracker, job_dir)
    with caplog.at_level(logging.WARNING, logger=mirror_module.__name__):
        mirror.sync()
    assert mirror.run_id is not None
    assert logged(tracker, mirror.run_id) == reported(job_dir) - Counter({("top(5)", 0.9, 3): 1})
    assert read_mirror_state(job_dir).refused_metrics == ("top(5)",)
    [warning] = [r.getMessage() for r in caplog.records if "top(5)" in r.getMessage()]
    assert "Invalid value" in warning  # MLflow's own words: MLflow refused it, the mirror did not


def test_mlflow_away_or_a_deleted_run_is_retried_not_set_aside(tmp_path: Path, job_dir: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mirror = trial_mirror(FailingTracker(uri, fail_calls={1}), job_dir)
    report(job_dir, 0, score=0.1)
    with pytest.raises(MlflowException):
        mirror.sync()  # the store is locked
    assert read_mirror_state(job_dir).synced_offset in (None, 0)  # no line marked as in the run
    mirror.sync()
    assert mirror.run_id is not None
    client = MlflowClient(uri)
    client.delete_run(mirror.run_id)  # someone deleted the run in the UI: every write is refused
    report(job_dir, 1, score=0.2)
    with pytest.raises(MlflowException, match="active"):
        mirror.sync()
    client.restore_run(mirror.run_id)
    mirror.sync()
    assert logged(mirror.tracker, mirror.run_id) == reported(job_dir)
    assert read_mirror_state(job_dir).refused_metrics == ()


# ------------------------------------------------------------------------------ restores


def test_each_restore_of_a_tiered_job_reaches_its_run_as_tags_and_a_restart_writes_the_same(
    tracker: MlflowTracker, job_dir: Path
) -> None:
    restores_file = JobPaths(job_dir).restores
    report(job_dir, 0, score=0.1)
    mirror = trial_mirror(tracker, job_dir)
    mirror.sync()
    assert mirror.run_id is not None
    client = MlflowClient(tracker.tracking_uri)
    assert tags.PREFIX + tags.RESTORED_FROM not in client.get_run(mirror.run_id).data.tags  # none yet

    record_restore(restores_file, 4, ["shared file system", "shared file system"])
    record_restore(restores_file, 9, ["own memory", "peer memory (10.231.0.12:4711)"])
    with restores_file.open("a") as torn:
        torn.write('{"step": 12, "tier"')  # a line being written: not a restore yet
    mirror.sync()

    run_tags = client.get_run(mirror.run_id).data.tags
    assert run_tags[tags.PREFIX + tags.RESTORED_FROM] == "peer memory"
    assert run_tags[tags.PREFIX + tags.RESTORED_STEP] == "9"
    listed = json.loads(run_tags[tags.PREFIX + tags.RESTORES])
    assert [(r["step"], r["tier"], r["sources"]) for r in listed] == [
        (4, "shared file system", ["shared file system", "shared file system"]),
        (9, "peer memory", ["own memory", "peer memory (10.231.0.12:4711)"]),
    ]
    again = trial_mirror(tracker, job_dir)  # a restarted orchestrator
    again.sync()
    assert client.get_run(mirror.run_id).data.tags == run_tags


def test_the_restores_tag_keeps_the_newest_restores_that_fit_a_tag() -> None:
    many = [Restore(step, "own memory", ("own memory",) * 40, 1.0) for step in range(200)]
    found = restore_tags("tunepod.", many)
    listed = json.loads(found["tunepod.restores"])
    assert len(found["tunepod.restores"]) <= mirror_module.MAX_TAG_CHARS
    assert listed[-1]["step"] == 199 and 1 < len(listed) < 200
    assert (found["tunepod.restored_from"], found["tunepod.restored_step"]) == ("own memory", "199")


# ------------------------------------------------------------------------------ worlds


def test_each_world_size_of_a_job_whose_group_changed_reaches_its_run_as_a_metric_at_its_step(
    tracker: MlflowTracker, job_dir: Path
) -> None:
    worlds_file = JobPaths(job_dir).worlds
    report(job_dir, 0, score=0.1)
    record_world(worlds_file, None, 4, 2, 0)  # the job's first world: nothing to say yet
    mirror = trial_mirror(tracker, job_dir)
    mirror.sync()
    assert mirror.run_id is not None
    client = MlflowClient(tracker.tracking_uri)
    name = tags.PREFIX + tags.WORLD_SIZE
    assert client.get_metric_history(mirror.run_id, name) == []
    assert name not in client.get_run(mirror.run_id).data.tags

    record_world(worlds_file, (4, 2), 2, 1, 8)  # a node lost: the survivors re-formed at step 8
    mirror.sync()
    history = [(m.step, m.value) for m in client.get_metric_history(mirror.run_id, name)]
    assert sorted(history) == [(0, 4.0), (8, 2.0)]
    assert client.get_run(mirror.run_id).data.tags[name] == "2"
    trial_mirror(tracker, job_dir).sync()  # a restarted orchestrator logs the same points again
    assert len(client.get_metric_history(mirror.run_id, name)) == 2
