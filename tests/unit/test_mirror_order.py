"""``RunMirror.sync``: a run's final record (its end) comes after every report of its job, even when
the job ends while a batch of its reports is being logged; a backlog of reports is logged batch by
batch, each saved as mirrored; a final objective that is the job's own last point is not logged
twice. The tracker is a recording double of the calls the mirror makes (MLflow itself is under the
mirror in tests/integration/test_tuner.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from tunepod.launch.paths import JobPaths
from tunepod.launch.submission import Submission, now_iso, write_submission
from tunepod.runtime.metrics import append_report
from tunepod.runtime.progress import Heartbeat
from tunepod.tracking import mirror as mirror_module
from tunepod.tracking import tags
from tunepod.tracking.mirror import Final, RunMirror, read_mirror_state
from tunepod.tracking.mlflow_tracker import MlflowTracker, Point


class RecordingTracker:
    """Records the writes in order: ("log_batch", (its points as (key, value, step), its tags)) or
    ("end_run", status). ``during_first_log`` runs inside the first write of points, and the write
    numbered ``fail_at`` (from 1) raises, as MLflow does while it is away."""

    def __init__(self, during_first_log: Callable[[], None] | None = None, fail_at: int = 0) -> None:
        self.calls: list[tuple[str, Any]] = []
        self._during_first_log = during_first_log
        self._fail_at = fail_at

    def log_batch(self, run_id: str, points: list[Point], values: dict[str, Any], params: Any = None) -> None:
        if len(self.calls) + 1 == self._fail_at:
            self._fail_at = 0
            raise ConnectionError("MLflow is not there")
        self.calls.append(("log_batch", ([(p.key, p.value, p.step) for p in points], dict(values))))
        if points and self._during_first_log is not None:
            hook, self._during_first_log = self._during_first_log, None
            hook()

    def end_run(self, run_id: str, status: str) -> None:
        self.calls.append(("end_run", status))

    def steps_logged(self) -> list[list[int | None]]:
        """The steps of each write's points, for the writes with points."""
        return [[step for _, _, step in points] for name, (points, _) in self.writes() if points]

    def writes(self) -> list[tuple[str, Any]]:
        return [(name, payload) for name, payload in self.calls if name == "log_batch"]


def test_the_run_ends_after_the_reports_the_job_wrote_while_a_batch_was_logged(tmp_path: Path) -> None:
    metrics = JobPaths(tmp_path).metrics
    for step in range(10):
        append_report(metrics, step, {"score": 0.5})
    final = Final(tags={tags.STATE: "COMPLETE"}, status="FINISHED")
    mirror: RunMirror | None = None

    def job_ends() -> None:  # the job's last reports, its end, and the tuner's finish, meanwhile
        for step in range(10, 20):
            append_report(metrics, step, {"score": 0.7})
        assert mirror is not None
        mirror.finish(final)

    tracker = RecordingTracker(job_ends)
    mirror = RunMirror(cast(MlflowTracker, tracker), tmp_path, run_id="run-1", mirror_telemetry=False)
    while not mirror.is_done:  # as the outbox does: sync again after every finish
        mirror.sync()

    assert [step for steps in tracker.steps_logged() for step in steps] == list(range(20))
    assert tracker.calls[-1] == ("end_run", "FINISHED")
    assert [name for name, _ in tracker.calls].index("end_run") == len(tracker.calls) - 1


def test_a_backlog_is_logged_batch_by_batch_and_each_saved_as_mirrored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mirror_module, "REPORTS_PER_BATCH", 4)
    for step in range(10):
        append_report(JobPaths(tmp_path).metrics, step, {"score": 0.5})
    tracker = RecordingTracker(fail_at=2)
    mirror = RunMirror(cast(MlflowTracker, tracker), tmp_path, run_id="run-1", mirror_telemetry=False)
    with pytest.raises(ConnectionError):
        mirror.sync()
    lines = JobPaths(tmp_path).metrics.read_bytes().splitlines(keepends=True)
    saved = read_mirror_state(tmp_path)
    assert saved.synced_offset == len(b"".join(lines[:4]))  # the first batch is in, and saved so
    assert saved.synced_step == 3
    mirror.sync()
    assert tracker.steps_logged() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    saved = read_mirror_state(tmp_path)
    assert (saved.synced_offset, saved.synced_step) == (len(b"".join(lines)), 9)


def test_a_final_objective_that_is_the_jobs_own_last_point_is_logged_once(tmp_path: Path) -> None:
    metrics = JobPaths(tmp_path).metrics
    for step, score in enumerate([0.1, 0.2, 0.3]):
        append_report(metrics, step, {"score": score, "accuracy": 0.7})
    append_report(metrics, 2, {"score": 0.35, "accuracy": 0.7})  # a resumed job redid step 2
    tracker = RecordingTracker()
    mirror = RunMirror(cast(MlflowTracker, tracker), tmp_path, run_id="run-1", mirror_telemetry=False)
    mirror.sync()
    objectives = (
        Point("score", 0.35, 2, timestamp_ms=1),  # the job's own point at step 2: not again
        Point("accuracy", 0.8, 2, timestamp_ms=1),  # what it passed to finish, not reported
        Point("score", 0.3, 1, timestamp_ms=1),  # not the point the job reported at step 1
    )
    mirror.finish(Final(tags={}, status="FINISHED", metrics=objectives))
    mirror.sync()
    _, (logged, _) = tracker.writes()[-1]  # the final record's write
    assert logged == [("accuracy", 0.8, 2), ("score", 0.3, 1)]


def test_a_job_that_ended_before_its_first_sync_is_written_in_one_write_then_ended(tmp_path: Path) -> None:
    """An outbox behind short trials finds a trial ended at its first sync: its job's tags, its
    reports, its ranks' figures and its final record go to MLflow in one write, then the run ends."""
    record = Submission(backend="local", name="trial-0", attempt=1, submission_id="s1", intent_at=now_iso())
    write_submission(JobPaths(tmp_path), record.accepted("4242", {}))
    for step in range(3):
        append_report(JobPaths(tmp_path).metrics, step, {"score": 0.1 * step})
    beat = Heartbeat(JobPaths(tmp_path).progress, 0, interval_s=3600).start()
    for step in range(3):
        beat.step_done(step, samples=4)
    beat._write()  # a beat of the heartbeat thread, now
    beat.finish()
    tracker = RecordingTracker()
    mirror = RunMirror(cast(MlflowTracker, tracker), tmp_path, run_id="run-1")
    objective = Point("accuracy", 0.9, 2, timestamp_ms=1)
    mirror.finish(Final(tags={tags.STATE: "COMPLETE"}, status="FINISHED", metrics=(objective,)))
    mirror.sync()

    assert [name for name, _ in tracker.calls] == ["log_batch", "end_run"]
    [(_, (points, written_tags))] = tracker.writes()
    assert [point for point in points if point[0] == "score"] == [("score", 0.1 * n, n) for n in range(3)]
    assert ("accuracy", 0.9, 2) in points
    assert {key for key, _, _ in points} >= {"rank0/step_time_s", "rank0/samples_per_s"}
    job_id, _, attempt = tags.job_tags(tags.PREFIX)
    assert written_tags[job_id] == "4242" and written_tags[attempt] == 1
    assert written_tags[tags.STATE] == "COMPLETE"
    saved = read_mirror_state(tmp_path)
    assert saved.finalized and saved.synced_offset == JobPaths(tmp_path).metrics.stat().st_size
