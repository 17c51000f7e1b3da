"""A job's per-rank telemetry into its MLflow run: what ``RunMirror.sync`` logs from real heartbeat
files, and how often. The tracker is a recording double of the calls the mirror makes (MLflow itself
is under the mirror in ``tests/integration/test_metrics_prometheus.py``, through a real tune)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from tunepod.launch.paths import JobPaths
from tunepod.runtime.progress import Heartbeat, read_progress
from tunepod.tracking import mirror as mirror_module
from tunepod.tracking import tags
from tunepod.tracking.mirror import Final, RunMirror
from tunepod.tracking.mlflow_tracker import MlflowTracker, Point


class RecordingTracker:
    """Records the points the mirror logs; the run exists (``run_id`` given to the mirror)."""

    def __init__(self) -> None:
        self.points: list[Point] = []

    def log_batch(self, run_id: str, points: list[Point], values: dict[str, Any], params: Any = None) -> None:
        self.points += points

    def end_run(self, run_id: str, status: str) -> None:
        pass


def mirror_of(tracker: RecordingTracker, job_dir: Path, **options: Any) -> RunMirror:
    return RunMirror(cast(MlflowTracker, tracker), job_dir, run_id="run-1", **options)


def test_each_ranks_figures_are_logged_under_its_rank_at_its_step_once_and_the_last_with_the_end(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(mirror_module, "TELEMETRY_MIRROR_S", 3600.0)  # no second log while it runs
    folder = JobPaths(tmp_path).progress
    ranks = [Heartbeat(folder, rank, interval_s=3600).start() for rank in (0, 1)]
    tracker = RecordingTracker()
    mirror = mirror_of(tracker, tmp_path)
    try:
        mirror.sync()  # nothing measured yet
        assert tracker.points == []
        for step in range(3):
            ranks[0].step_done(step, samples=2, tokens=16)
            ranks[1].step_done(step, samples=2, tokens=16)
        for beat in ranks:
            beat._write()  # a beat of the heartbeat thread, now
        mirror.sync()
        assert {point.step for point in tracker.points} == {2}
        assert sorted(point.key for point in tracker.points) == sorted(
            f"rank{rank}/{figure}"
            for rank in (0, 1)
            for figure in ("step_time_s", "samples_per_s", "tokens_per_s", "peak_memory_bytes", "cpu_busy")
        )
        beats = {beat.rank: beat.telemetry for beat in read_progress(folder)}
        measured = {int(t.measured_at * 1000) for t in beats.values() if t}
        assert {point.timestamp_ms for point in tracker.points} == measured

        ranks[0].step_done(3, samples=2, tokens=16)
        ranks[0]._write()
        mirror.sync()  # newer figures, within TELEMETRY_MIRROR_S of the last logged ones
        assert len(tracker.points) == 10

        mirror.finish(Final(tags={tags.STATE: "COMPLETE"}, status="FINISHED"))
        mirror.sync()  # the end: the last figures, whatever the time, and only the new ones
        assert {(point.step, point.key.split("/")[0]) for point in tracker.points[10:]} == {(3, "rank0")}
        assert mirror.is_done
    finally:
        for beat in ranks:
            beat.finish()


def test_after_the_interval_newer_figures_are_logged_while_the_job_runs(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(mirror_module, "TELEMETRY_MIRROR_S", 0.0)
    beat = Heartbeat(JobPaths(tmp_path).progress, 0, interval_s=3600).start()
    tracker = RecordingTracker()
    mirror = mirror_of(tracker, tmp_path)
    try:
        for step in range(4):
            beat.step_done(step, samples=1)
            beat._write()
            mirror.sync()
            mirror.sync()  # nothing newer: nothing logged
        assert sorted({point.step for point in tracker.points}) == [1, 2, 3]
        assert all(point.key != "rank0/tokens_per_s" for point in tracker.points)
    finally:
        beat.finish()


def test_a_job_writing_into_another_jobs_run_logs_no_telemetry(tmp_path: Path) -> None:
    """An evaluation writes into its trial's run: its ranks' figures must not mix with the training's."""
    beat = Heartbeat(JobPaths(tmp_path).progress, 0, interval_s=3600).start()
    tracker = RecordingTracker()
    mirror = mirror_of(tracker, tmp_path, tag_prefix=tags.step_tag("check", ""))
    try:
        beat.step_done(0, samples=1)
        beat.step_done(1, samples=1)
        beat._write()
        mirror.sync()
        assert tracker.points == []
    finally:
        beat.finish()
