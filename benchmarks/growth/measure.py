"""What the growth benchmark reads while the orchestrator runs, and how it cuts the run into tenths.

A sample is the orchestrator's CPU seconds against the reports it has consumed. The CPU comes from
``/proc/<pid>/stat`` (user + system time of every thread of the process, not of its children: the
jobs and Prefect's temporary server are children). Reports consumed: the least of what the job wrote
(the lines of its metrics file), what the orchestrator mirrored into MLflow (``synced_step`` in the
job dir's ``mlflow.json``) and what it told Optuna (the trial's last intermediate step in the
study's storage). An orchestrator that falls behind the job is thus charged for the reports it
handles, when it handles them, not for those the job wrote meanwhile.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far; None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # Fields after the command name (in parentheses, which may hold spaces): state is field 3,
    # utime and stime are fields 14 and 15.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


class LineCounter:
    """The newline-terminated lines of a growing file, counting only what was appended since the last
    call (the benchmark must not slow down as the file grows, any more than the orchestrator)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = 0
        self._offset = 0

    def count(self) -> int:
        self.new_lines()
        return self.lines

    def new_lines(self) -> list[str]:
        """The whole lines appended since the last call."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        lines = whole.decode("utf-8", errors="replace").splitlines()
        self.lines += len(lines)
        return lines


class OptunaProgress:
    """The last step the orchestrator told Optuna for trial ``number`` of the study's storage, read
    incrementally from a journal file, or with one query from SQLite; -1 before any."""

    # Optuna's JournalOperation.SET_TRIAL_INTERMEDIATE_VALUE.
    _SET_INTERMEDIATE_VALUE = 7

    def __init__(self, storage_uri: str, number: int) -> None:
        self.uri = storage_uri
        self.number = number
        self.step = -1
        self._journal = LineCounter(Path(storage_uri.removeprefix("journal://")))

    def read(self) -> int:
        if self.uri.startswith("sqlite:///"):
            return self._read_sqlite(self.uri.removeprefix("sqlite:///"))
        for line in self._journal.new_lines():
            if f'"op_code":{self._SET_INTERMEDIATE_VALUE},' in line:
                self.step = max(self.step, int(json.loads(line)["step"]))
        return self.step

    def _read_sqlite(self, path: str) -> int:
        query = (
            "SELECT MAX(v.step) FROM trial_intermediate_values v JOIN trials t ON t.trial_id = v.trial_id"
            " WHERE t.number = ?"
        )
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
                found = db.execute(query, (self.number,)).fetchone()[0]
        except sqlite3.OperationalError:  # locked, or the tables not made yet: as far as last time
            return self.step
        self.step = -1 if found is None else int(found)
        return self.step


@dataclass(frozen=True)
class Sample:
    at_s: float
    """Seconds since the orchestrator was launched."""
    cpu_s: float
    reports: int
    """Reports consumed by the orchestrator (see the module docstring)."""
    written: int
    """Reports the job wrote."""
    mirrored: int
    """The last step mirrored into MLflow (-1: none)."""
    told: int
    """The last step told Optuna (-1: none)."""


@dataclass(frozen=True)
class Tenth:
    index: int
    """1 to 10."""
    reports: int
    cpu_s: float
    wall_s: float

    @property
    def cpu_ms_per_1000(self) -> float:
        return self.cpu_s * 1000 / self.reports * 1000


def cpu_at(samples: list[Sample], reports: float) -> tuple[float, float]:
    """(CPU seconds, wall seconds) when the reports consumed crossed ``reports``.

    The count moves in batches (the MLflow mirror saves how far it got after each batch it logged), so
    the crossing is placed between the two samples where the count last changed (the first batch: since
    the job's first report), as if the batch had been worked through evenly since the one before; the
    CPU is the sampled CPU at that moment."""
    start = first_report(samples)
    changes = [s for before, s in itertools.pairwise(samples[start:]) if s.reports != before.reports]
    for before, after in itertools.pairwise([samples[start], *changes]):
        if before.reports <= reports <= after.reports and after.reports > before.reports:
            share = (reports - before.reports) / (after.reports - before.reports)
            at_s = before.at_s + share * (after.at_s - before.at_s)
            return cpu_at_time(samples, at_s), at_s
    raise ValueError(f"no samples around {reports} reports")


def first_report(samples: list[Sample]) -> int:
    """The index of the last sample before the job's first report (0 when it reported at once)."""
    return max(0, next((i for i, s in enumerate(samples) if s.written > 0), len(samples)) - 1)


def cpu_at_time(samples: list[Sample], at_s: float) -> float:
    """The orchestrator's CPU seconds at ``at_s``, interpolated between the samples around it."""
    for before, after in itertools.pairwise(samples):
        if before.at_s <= at_s <= after.at_s:
            share = (at_s - before.at_s) / (after.at_s - before.at_s) if after.at_s > before.at_s else 0.0
            return before.cpu_s + share * (after.cpu_s - before.cpu_s)
    raise ValueError(f"no samples around {at_s} s")


def tenths(samples: list[Sample], total: int) -> list[Tenth]:
    """The run cut where the reports consumed crossed each tenth of ``total``: the first tenth starts
    at the last sample before the job's first report, the last one ends when the last report was
    consumed (what the trial's end costs after that is ``trial_end``'s)."""
    if samples[-1].reports < total:
        raise ValueError(f"the orchestrator consumed {samples[-1].reports:,} of {total:,} reports")
    started = samples[first_report(samples)]
    bounds = [(started.cpu_s, started.at_s)] + [cpu_at(samples, total * k / 10) for k in range(1, 11)]
    return [
        Tenth(k + 1, round(total / 10), bounds[k + 1][0] - bounds[k][0], bounds[k + 1][1] - bounds[k][1])
        for k in range(10)
    ]


def trial_end(samples: list[Sample], total: int, end: Sample) -> tuple[float, float]:
    """(CPU seconds, wall seconds) from the last report consumed to ``end``, the trial's end: its
    outcome told, its MLflow record (and logged model) written."""
    cpu_s, at_s = cpu_at(samples, total)
    return end.cpu_s - cpu_s, end.at_s - at_s
