"""``ReportTail``: the orchestrator reads only what a job appended since its last look."""

from __future__ import annotations

import json
from pathlib import Path

from tunepod.runtime import ReportTail
from tunepod.runtime.metrics import append_report


def test_reads_each_report_once_and_waits_for_a_line_being_written(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    tail = ReportTail(metrics)
    assert tail.read_new() == []
    append_report(metrics, 0, {"loss": 1.0})
    append_report(metrics, 1, {"loss": 0.5})
    assert [r.step for r in tail.read_new()] == [0, 1]
    assert tail.read_new() == []
    line = json.dumps({"step": 2, "metrics": {"loss": 0.25}, "time": 1.0})
    with open(metrics, "a") as handle:
        handle.write(line[:10])  # a write in progress
    assert tail.read_new() == []
    with open(metrics, "a") as handle:
        handle.write(line[10:] + "\n")
    assert [r.step for r in tail.read_new()] == [2]


def test_a_replaced_shorter_file_is_read_from_the_top(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    for step in range(3):
        append_report(metrics, step, {"loss": 1.0})
    tail = ReportTail(metrics)
    assert len(tail.read_new()) == 3
    metrics.unlink()
    append_report(metrics, 7, {"loss": 1.0})
    assert [r.step for r in tail.read_new()] == [7]


def test_a_broken_line_is_skipped(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        '{"step": 0, "metrics": {"a": 1}, "time": 1}\nnot json\n{"step": 1, "metrics": {"a": 2}, "time": 2}\n'
    )
    assert [r.step for r in ReportTail(metrics).read_new()] == [0, 1]
