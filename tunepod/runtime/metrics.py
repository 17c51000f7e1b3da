"""The metrics file and the result file: how a job tells the orchestrator how it is doing.

Ownership: rank 0 of the job is the only writer of both files. It appends one JSON line per report to
the metrics file (``{"step": int, "metrics": {name: float}, "time": float}``; a line that does not fit
on a full disk is cut back off and raises ``DiskFullError``) and, when it finishes
well, writes the result file once, atomically (``{"metrics": {...}, "step": int | None, "time": float}``).
The orchestrator only reads them, possibly while the job is still writing, hence the tolerance of
``read_reports`` for a last line that is still being written.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunepod.runtime.files import append_line_durably, disk_full_explained, write_bytes_atomic

log = logging.getLogger(__name__)

# (file, line number) of malformed lines already warned about: the orchestrator rereads the file on
# every poll and should say so once, not twice a second. Set operations are atomic under the GIL.
_warned_lines: set[tuple[str, int]] = set()


@dataclass(frozen=True)
class Report:
    """One line of the metrics file: the metrics of one step (an epoch, for the examples).

    ``time`` is seconds since the epoch (``time.time()``) on the job's rank 0 when it reported.
    """

    step: int
    metrics: dict[str, float]
    time: float


@dataclass(frozen=True)
class Result:
    """The result file of a job that finished well: its final metrics and its last reported step."""

    metrics: dict[str, float]
    step: int | None
    time: float


def checked_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``metrics`` as plain floats; ``TypeError``/``ValueError`` naming the offending metric otherwise.

    Any real number is accepted (int, float, numpy scalars); booleans, strings, tensors and NaN or
    infinite values are rejected, because a pruner or a registry comparing them would silently do
    the wrong thing.
    """
    if not metrics:
        raise ValueError("no metrics given; pass them as keywords, e.g. report(3, val_accuracy=0.91)")
    checked = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(
                f"metric {name!r} must be a real number, got {type(value).__name__} {value!r}"
                " (for a tensor, pass tensor.item())"
            )
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"metric {name!r} is {number}; only finite values can be reported")
        checked[name] = number
    return checked


def checked_step(step: Any) -> int:
    """``step`` as an int; ``TypeError``/``ValueError`` if it is not a non-negative integer."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return int(step)


def append_report(path: Path, step: int, metrics: Mapping[str, Any]) -> Report:
    """Validate and append one report line to the metrics file at ``path``; rank 0 calls this."""
    report = Report(step=checked_step(step), metrics=checked_metrics(metrics), time=time.time())
    line = {"step": report.step, "metrics": report.metrics, "time": report.time}
    fix = "free space there, or give the job's folder (the launcher's root) a larger filesystem"
    with disk_full_explained(path, f"{fix}; the reports before this one are intact"):
        append_line_durably(path, json.dumps(line, allow_nan=False))
    return report


def read_reports(path: Path) -> list[Report]:
    """Every report in the metrics file at ``path``, in the order written; ``[]`` if it does not exist.

    Safe to call while the job appends. A last line without its newline is a write in progress and is
    kept only if it is already a whole report. A broken line in the middle (left by a job killed
    mid-write and then resumed) is skipped with a logged warning. A resumed job may report a step
    again (it redoes the steps after its last checkpoint): the later line is the one that counts.
    """
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    reports = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        report = _parse_report(line)
        if report is not None:
            reports.append(report)
        elif number < len(lines) and (str(path), number) not in _warned_lines:
            # A complete (newline-terminated) line that is not a report.
            _warned_lines.add((str(path), number))
            log.warning("skipping malformed line %d of %s: %.200s", number, path, line)
    return reports


class ReportTail:
    """Reads the reports appended to a metrics file since the last call, from where it stopped.

    Cost per call grows with what was appended, not with the file: a job that reports for days is
    not re-read from the top every poll. Only whole (newline-terminated) lines are consumed; a line
    still being written is read on a later call. A file that shrank (replaced) is read from the top.
    One reader per instance; not thread safe.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self._line = 0

    def read_new(self) -> list[Report]:
        try:
            with open(self.path, "rb") as handle:
                if handle.seek(0, 2) < self.offset:
                    self.offset, self._line = 0, 0
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        reports = []
        for line in complete.decode("utf-8", errors="replace").splitlines():
            self._line += 1
            if not line.strip():
                continue
            report = _parse_report(line)
            if report is not None:
                reports.append(report)
            elif (str(self.path), self._line) not in _warned_lines:
                _warned_lines.add((str(self.path), self._line))
                log.warning("skipping malformed line %d of %s: %.200s", self._line, self.path, line)
        return reports


def _parse_report(line: str) -> Report | None:
    try:
        raw = json.loads(line)
        return Report(
            step=checked_step(raw["step"]), metrics=checked_metrics(raw["metrics"]), time=float(raw["time"])
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def write_result(path: Path, metrics: Mapping[str, Any], step: int | None) -> Result:
    """Validate ``metrics`` and write the result file at ``path`` atomically; rank 0 calls this."""
    result = Result(metrics=checked_metrics(metrics), step=step, time=time.time())
    body = {"metrics": result.metrics, "step": result.step, "time": result.time}
    write_bytes_atomic(path, (json.dumps(body, allow_nan=False, indent=2) + "\n").encode("utf-8"))
    return result


def read_result(path: Path) -> Result | None:
    """The result file at ``path``, or ``None`` if the job has not written it.

    The file is written atomically, so a file that exists is whole; one that does not parse was not
    written by ``tunepod.runtime`` and raises ``ValueError`` naming the file.
    """
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        step = None if raw["step"] is None else checked_step(raw["step"])
        return Result(metrics=checked_metrics(raw["metrics"]), step=step, time=float(raw["time"]))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"result file {path} is not a tunepod result ({exc!r})") from exc
