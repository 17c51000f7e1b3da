"""The tracking outbox: a failing sync never reaches the caller, is retried with backoff, and
``flush`` waits (bounded) until everything caught up; several mirrors are synced at once, one mirror
never on two threads at once.

The mirrors here are test doubles of what the outbox uses of a ``RunMirror`` (``sync``,
``run_id``, ``job_dir``): the outbox's own retry logic is what is under test. Against a real
MLflow server that is killed and restarted, see ``tests/e2e/test_faults.py``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tunepod.tracking.mirror import RunMirror, RunPlan
from tunepod.tracking.outbox import TrackingOutbox


class FlakyMirror:
    """Fails its first ``failures`` syncs (as MLflow does while it is down), then succeeds."""

    def __init__(self, failures: int) -> None:
        self.job_dir = Path("/jobs/flaky")
        self.run_id = "run"
        self.tracker = SimpleNamespace(tracking_uri="http://mlflow.invalid:5000")  # what the outbox reads
        self.failures = failures
        self.calls = 0
        self.lock = threading.Lock()

    def sync(self) -> None:
        with self.lock:
            self.calls += 1
            if self.calls <= self.failures:
                raise ConnectionError("MLflow is not there")


def as_mirror(double: Any) -> RunMirror:
    return cast(RunMirror, double)


def test_a_failing_sync_is_retried_until_it_works_and_never_raises_to_the_caller() -> None:
    outbox = TrackingOutbox(max_backoff_s=0.05)
    try:
        mirror = FlakyMirror(failures=3)
        outbox.add(as_mirror(mirror))  # returns at once, whatever MLflow does
        assert outbox.flush(timeout_s=30)
        assert mirror.calls == 4
        assert outbox.num_waiting == 0
    finally:
        outbox.close()


def test_flush_gives_up_after_its_timeout_and_keeps_the_work() -> None:
    outbox = TrackingOutbox(max_backoff_s=0.05)
    try:
        mirror = FlakyMirror(failures=10**9)
        outbox.add(as_mirror(mirror))
        started = time.monotonic()
        assert not outbox.flush(timeout_s=0.5)
        assert time.monotonic() - started < 10
        assert outbox.num_waiting == 1
    finally:
        outbox.close()


def test_one_failing_run_does_not_hold_back_the_others() -> None:
    outbox = TrackingOutbox(max_backoff_s=0.05)
    try:
        stuck, healthy = FlakyMirror(failures=10**9), FlakyMirror(failures=0)
        outbox.add(as_mirror(stuck))
        outbox.add(as_mirror(healthy))
        deadline = time.monotonic() + 10
        while healthy.calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert healthy.calls >= 1
        assert outbox.num_waiting == 1
    finally:
        outbox.close()


class GatedMirror:
    """Its sync waits (bounded) until ``gate`` is set; counts how many of its syncs run at once."""

    def __init__(self, name: str, gate: threading.Event, run_id: str | None = "run") -> None:
        self.job_dir = Path("/jobs") / name
        self.run_id = run_id
        self.gate = gate
        self.started = threading.Event()
        self.calls = 0
        self.inside = 0
        self.most_inside = 0
        self.lock = threading.Lock()

    def sync(self) -> None:
        with self.lock:
            self.calls += 1
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        self.started.set()
        try:
            self.gate.wait(timeout=30)
        finally:
            with self.lock:
                self.inside -= 1


def test_a_slow_sync_does_not_hold_back_a_new_run() -> None:
    """A trial's job waits for its run to exist: it must not queue behind another run's slow write."""
    outbox = TrackingOutbox(max_backoff_s=0.05, threads=1)  # as for a SQLite store
    slow_gate = threading.Event()
    try:
        slow = GatedMirror("slow", slow_gate)
        outbox.add(as_mirror(slow))
        assert slow.started.wait(timeout=10)
        fresh_gate = threading.Event()
        fresh_gate.set()
        fresh = GatedMirror("fresh", fresh_gate, run_id=None)
        outbox.add(as_mirror(fresh))
        deadline = time.monotonic() + 5
        while fresh.calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fresh.calls == 1
        assert slow.inside == 1  # while the slow sync was still under way
    finally:
        slow_gate.set()
        outbox.close()


def test_one_mirror_is_never_synced_on_two_threads_at_once() -> None:
    outbox = TrackingOutbox(max_backoff_s=0.05, threads=4)
    gate = threading.Event()
    try:
        mirror = GatedMirror("busy", gate)
        outbox.add(as_mirror(mirror))
        assert mirror.started.wait(timeout=10)
        for _ in range(5):  # new reports keep coming while its sync is under way
            outbox.add(as_mirror(mirror))
        time.sleep(0.3)  # time for an idle thread to (wrongly) take it
        assert mirror.calls == 1
        gate.set()
        assert outbox.flush(timeout_s=10)
        assert mirror.calls == 2  # the adds made meanwhile: one more sync, after the first
        assert mirror.most_inside == 1
    finally:
        gate.set()
        outbox.close()


def test_an_mlflow_error_quoting_the_tracking_uri_is_logged_redacted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MLflow's client quotes the tracking server's URL, login included, in its errors: the outbox's
    warning shows it as every store URI is shown, the password hidden. (A tracker that cannot reach its
    server stands in for MLflow's client against a server that is down.)"""

    class Unreachable:
        tracking_uri = "http://tunepod:s3cret-Pa55@127.0.0.1:5000"

        def start_run(self, *args: object, **kwargs: object) -> str:
            raise ConnectionError(f"API request to {self.tracking_uri}/api/2.0/mlflow/runs/create failed")

    mirror = RunMirror(cast(Any, Unreachable()), tmp_path, plan=RunPlan("k", "trial-0", None, {}, {}))
    outbox = TrackingOutbox(max_backoff_s=0.05, threads=1)
    try:
        with caplog.at_level("WARNING"):
            outbox.add(mirror)
            assert not outbox.flush(timeout_s=0.5)
    finally:
        outbox.close()
    assert "s3cret-Pa55" not in caplog.text
    assert "http://tunepod:***@127.0.0.1:5000/api/2.0/mlflow/runs/create" in caplog.text
