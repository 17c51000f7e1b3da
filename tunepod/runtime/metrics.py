"""The metrics file and the result file: how a job tells the orchestrator how it is doing.

Ownership: rank 0 of the job is the only writer of both files. It appends one JSON line per report to
the metrics file (``{"step": int, "metrics": {name: float}, "time": float}``; a line that does not fit
on a full disk is cut back off and raises ``DiskFullError``) and, when it finishes
well, writes the result file once, atomically (``{"metrics": {...}, "step": int | None, "time": float}``).
The orchestrator only reads them, possibly while the job is still writing, hence the tolerance of
``read_reports`` for a last line that is still being written.

Both writers take only metric names MLflow takes (``metric_name_problem``): the orchestrator mirrors
every report into MLflow, and a name refused there is better refused at ``report`` than found missing
from the run. The readers take any name (a job on an older runtime, a script writing the file itself).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import posixpath
import re
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

MAX_STEP = 2**63 - 1
"""MLflow and Optuna's storages keep a step as a signed 64-bit integer."""
MAX_METRIC_NAME_CHARS = 250
"""MLflow's limit on a metric name (``MAX_ENTITY_KEY_LENGTH`` in ``mlflow.utils.validation``)."""
METRIC_NAME_CHARACTERS = (
    "letters, digits, underscores (_), dashes (-), periods (.), spaces ( ), colons (:) and slashes (/)"
)
# MLflow 3.17's rule (``validate_param_and_metric_name``) on a POSIX tracking server or store; ``\w``
# is Unicode, as there. Matched whole: MLflow's ``^...$`` also lets a trailing newline through.
_METRIC_NAME = re.compile(r"[/\w.\- :]*")


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


def metric_name_problem(name: str) -> str | None:
    """Why MLflow would refuse ``name`` as a metric name (the rule of MLflow 3.17's
    ``_validate_metric_name`` and its length limit, on a POSIX server or store), or None if it takes it."""
    if len(name) > MAX_METRIC_NAME_CHARS:
        return f"it is {len(name)} characters long; MLflow takes at most {MAX_METRIC_NAME_CHARS}"
    if _METRIC_NAME.fullmatch(name) is None:
        return f"a name may only contain {METRIC_NAME_CHARACTERS}"
    normalized = posixpath.normpath(name)
    if normalized != name or normalized == "." or normalized.startswith(("..", "/")):
        # MLflow keeps names as paths (a file store's files): two names must not be one path.
        return (
            f"a name may only contain {METRIC_NAME_CHARACTERS}, and MLflow keeps it as a file path: it "
            "may not be empty, start with '/' or '..', end with '/', or hold '//', '/./' or '/../'"
        )
    return None


def loggable_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """``checked_metrics``, whose names are also all names MLflow takes: ``ValueError`` naming the
    metric, the problem and the allowed characters otherwise. What ``report`` and ``finish`` write."""
    checked = checked_metrics(metrics)
    for name in checked:
        problem = metric_name_problem(name)
        if problem is not None:
            raise ValueError(f"metric name {name!r} cannot be logged to MLflow: {problem}")
    return checked


def checked_step(step: Any) -> int:
    """``step`` as an int; ``TypeError``/``ValueError`` if it is not an integer in [0, ``MAX_STEP``]."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if int(step) > MAX_STEP:
        raise ValueError(f"step must be at most {MAX_STEP} (MLflow and Optuna store 64 bits), got {step}")
    return int(step)


def append_report(path: Path, step: int, metrics: Mapping[str, Any]) -> Report:
    """Validate and append one report line to the metrics file at ``path``; rank 0 calls this."""
    report = Report(step=checked_step(step), metrics=loggable_metrics(metrics), time=time.time())
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
        """Bytes of the file consumed: whole lines, from its start."""
        self._line = 0

    def read_new(self) -> list[Report]:
        return [report for report, _ in self.read_new_with_ends()]

    def read_new_with_ends(self) -> list[tuple[Report, int]]:
        """The new reports, each with the offset in the file just past its line: where a reader that
        has taken it, and every line before it, carries on."""
        try:
            with open(self.path, "rb") as handle:
                if handle.seek(0, 2) < self.offset:
                    self.offset, self._line = 0, 0
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        complete = data[: data.rfind(b"\n") + 1]
        reports = []
        for raw in complete.split(b"\n")[:-1]:
            self._line += 1
            self.offset += len(raw) + 1
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            report = _parse_report(line)
            if report is not None:
                reports.append((report, self.offset))
            elif (str(self.path), self._line) not in _warned_lines:
                _warned_lines.add((str(self.path), self._line))
                log.warning("skipping malformed line %d of %s: %.200s", self._line, self.path, line)
        return reports


def _parse_report(line: str) -> Report | None:
    try:
        raw = json.loads(line)
        report = Report(
            step=checked_step(raw["step"]), metrics=checked_metrics(raw["metrics"]), time=float(raw["time"])
        )
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    # A time that is no time (NaN, infinite, before the epoch) is no point MLflow takes either.
    return report if math.isfinite(report.time) and report.time >= 0 else None


def write_result(path: Path, metrics: Mapping[str, Any], step: int | None) -> Result:
    """Validate ``metrics`` and write the result file at ``path`` atomically; rank 0 calls this."""
    result = Result(metrics=loggable_metrics(metrics), step=step, time=time.time())
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
