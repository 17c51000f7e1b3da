"""``tunepod run``'s view of a run as it goes: each step, and each tune step's study as it moves.

On a terminal, a live table (rich) redrawn twice a second, as Ray Tune's status table and Optuna's
progress bar show a study: for each step its kind, state and elapsed time; for a tune step the trials
running, paused, pruned, exploited, completed and failed, the best value so far and its trial, and the
trials left. Elsewhere (CI, a log file) one line per event, which reads top to bottom and greps:

    search/trial-3 Pruned: pruned at step 3 (value 0.42) by the hyperband pruner | 5 of 16 ended, ...

It is a ``tunepod.watch.Watcher``: told from the run's threads, so every method takes the lock.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import TextIO

from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table

from tunepod.hpo.endings import ENDING_NAMES, ending_line
from tunepod.outputs import TrialRecord
from tunepod.watch import StudyStart

RUNNING = "RUNNING"
#: Off a terminal, a step's progress is a line at most this often (and one when it completes).
PROGRESS_LINE_EVERY_S = 10.0
#: What counts as ended for "trials left": a paused trial may resume.
_ENDED = ("COMPLETE", "PRUNED", "EXPLOITED", "FAIL")
_COLUMNS = (RUNNING, "PAUSED", "PRUNED", "EXPLOITED", "COMPLETE", "FAIL")
_HEADERS = {RUNNING: "running", **{key: ENDING_NAMES[key].lower() for key in _COLUMNS[1:]}}


@dataclass
class _Step:
    uses: str
    started_at: float
    ended_after: float | None = None
    ok: bool | None = None
    study: StudyStart | None = None
    trials: dict[int, str] = field(default_factory=dict)
    """Each trial this run drove: RUNNING, or its ending (set through ``put``)."""
    by_state: Counter[str] = field(default_factory=Counter)
    """``trials`` counted by state, kept as they change: a line per trial must not count them all."""
    best: tuple[int, float] | None = None
    progress: tuple[float, float, str] | None = None
    """How far a long piece of the step's work got: done, total, unit."""
    said_progress_at: float = 0.0

    def put(self, number: int, state: str) -> None:
        """Trial ``number`` is in ``state`` now."""
        before = self.trials.get(number)
        if before is not None:
            self.by_state[before] -= 1
        self.trials[number] = state
        self.by_state[state] += 1

    def counts(self) -> Counter[str]:
        counts = +self.by_state
        if self.study is not None:  # what earlier runs ended, and this run has not driven again
            counts.update(self.study.finished)
        return counts

    def better(self, value: float) -> bool:
        maximize = self.study is not None and self.study.direction == "maximize"
        return self.best is None or (value > self.best[1] if maximize else value < self.best[1])

    def elapsed(self, now: float) -> float:
        return self.ended_after if self.ended_after is not None else now - self.started_at


class RunView:
    """Shows a run's steps and studies on ``console``: live when ``live``, else a line per event.
    Use it as a context manager around the run (``live`` starts and stops the table there)."""

    def __init__(self, console: Console, *, live: bool) -> None:
        self.console = console
        self._steps: dict[str, _Step] = {}
        self._lock = threading.Lock()
        self._live = Live(self, console=console, refresh_per_second=2, transient=False) if live else None
        self._moved: list[tuple[logging.StreamHandler[TextIO], TextIO]] = []

    def __enter__(self) -> RunView:
        if self._live is not None:
            streams = (sys.stdout, sys.stderr)
            self._live.start()  # from here sys.stdout and sys.stderr write above the table
            self._moved = _point_handlers(streams, (sys.stdout, sys.stderr))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
            for handler, stream in self._moved:
                handler.setStream(stream)

    # ------------------------------------------------------------------------------ watcher

    def step_started(self, step: str, uses: str) -> None:
        with self._lock:
            self._steps[step] = _Step(uses, time.monotonic())
        self._say(f"step {step} ({uses}) started")

    def step_ended(self, step: str, ok: bool) -> None:
        with self._lock:
            board = self._steps.get(step)
            if board is None:
                return
            board.ended_after, board.ok = time.monotonic() - board.started_at, ok
            how = "done" if ok else "failed"
            line = f"step {step} ({board.uses}) {how} after {_clock(board.ended_after)}"
        self._say(line)

    def study_started(self, study: StudyStart) -> None:
        with self._lock:
            board = self._steps.setdefault(study.step, _Step("tune", time.monotonic()))
            board.study, board.best = study, study.best
            earlier = sum(study.finished.get(key, 0) for key in _ENDED)
            line = (
                f"{study.step}: study {study.study}, {study.num_trials} trials ({earlier} ended in earlier "
                f"runs), {study.direction} {study.metric}"
            )
        self._say(line)

    def trial_started(self, step: str, number: int) -> None:
        with self._lock:
            board = self._steps.setdefault(step, _Step("tune", time.monotonic()))
            self._forget_earlier(board, number)
            board.put(number, RUNNING)
            line = f"{step}/trial-{number} started | {self._status(board)}"
        self._say(line)

    def trial_ended(self, step: str, record: TrialRecord) -> None:
        with self._lock:
            board = self._steps.setdefault(step, _Step("tune", time.monotonic()))
            board.put(record.number, record.ending or record.outcome)
            if record.outcome == "COMPLETE" and record.value is not None and board.better(record.value):
                board.best = (record.number, record.value)
            line = f"{ending_line(record, step)} | {self._status(board)}"
        self._say(line)

    def step_progress(self, step: str, done: float, total: float, unit: str) -> None:
        with self._lock:
            board = self._steps.setdefault(step, _Step("", time.monotonic()))
            board.progress = (done, total, unit)
            now = time.monotonic()
            # Off a terminal: a line now and then (and at the end), not one per redraw.
            if done < total and now - board.said_progress_at < PROGRESS_LINE_EVERY_S:
                return
            board.said_progress_at = now
            line = f"step {step}: {_amount(done, total, unit)} | {_clock(board.elapsed(now))}"
        self._say(line)

    # ------------------------------------------------------------------------------ showing

    def _say(self, line: str) -> None:
        if self._live is None:
            self.console.print(line, highlight=False, soft_wrap=True)
        else:
            self._live.refresh()

    def _forget_earlier(self, board: _Step, number: int) -> None:
        """A trial an earlier run paused, promoted now, is no longer counted among that run's."""
        if board.study is not None and number not in board.trials and board.study.finished.get("PAUSED"):
            finished = dict(board.study.finished)
            finished["PAUSED"] -= 1
            board.study = replace(board.study, finished=finished)

    def _status(self, board: _Step) -> str:
        counts = board.counts()
        shown = ", ".join(f"{counts[key]} {_HEADERS[key]}" for key in _COLUMNS if counts[key])
        ended = sum(counts[key] for key in _ENDED)
        total = board.study.num_trials if board.study is not None else ended
        best = "" if board.best is None else f" | best {board.best[1]:.6g} (trial {board.best[0]})"
        left, elapsed = max(0, total - ended), _clock(board.elapsed(time.monotonic()))
        return f"{shown}{best} | {ended} of {total} ended, {left} left | {elapsed}"

    def __rich__(self) -> RenderableType:
        table = Table(title="tunepod run", title_justify="left", expand=False)
        for header in ("step", "kind", "state", *(_HEADERS[key] for key in _COLUMNS), "best", "left", "time"):
            table.add_column(
                header, justify="left" if header in ("step", "kind", "state", "best") else "right"
            )
        now = time.monotonic()
        with self._lock:
            for name, board in self._steps.items():
                table.add_row(*self._row(name, board, now))
        return table

    def _row(self, name: str, board: _Step, now: float) -> list[str]:
        state = "running" if board.ok is None else ("done" if board.ok else "[red]failed[/red]")
        if board.ok is None and board.progress is not None:
            state = f"running: {_amount(*board.progress)}"
        if board.study is None and not board.trials:
            return [name, board.uses, state, *([""] * len(_COLUMNS)), "", "", _clock(board.elapsed(now))]
        counts = board.counts()
        total = board.study.num_trials if board.study is not None else 0
        left = str(max(0, total - sum(counts[key] for key in _ENDED)))
        best = "" if board.best is None else f"{board.best[1]:.6g} (trial {board.best[0]})"
        cells = [str(counts[key]) if counts[key] else "" for key in _COLUMNS]
        return [name, board.uses, state, *cells, best, left, _clock(board.elapsed(now))]


def _point_handlers(
    old: tuple[TextIO, TextIO], new: tuple[TextIO, TextIO]
) -> list[tuple[logging.StreamHandler[TextIO], TextIO]]:
    """Point every logging handler that writes to the real stdout or stderr (made before the table
    started: Optuna's, MLflow's) at the table's stand-ins, so that its lines print above the table
    instead of through it; returns each handler moved, with the stream to give back."""
    moved: list[tuple[logging.StreamHandler[TextIO], TextIO]] = []
    loggers = [logging.getLogger(), *(logging.getLogger(name) for name in logging.root.manager.loggerDict)]
    for handler in {handler for logger in loggers for handler in logger.handlers}:
        if isinstance(handler, logging.StreamHandler) and handler.stream in old:
            stream = handler.stream
            handler.setStream(new[old.index(stream)])
            moved.append((handler, stream))
    return moved


def _amount(done: float, total: float, unit: str) -> str:
    """``45% (1.2 GB of 2.7 GB)``, ``2 of 3 evaluations``."""
    if unit != "bytes":
        return f"{done:g} of {total:g} {unit}"
    share = f"{100 * done / total:.0f}% " if total else ""
    return f"{share}({_size(done)} of {_size(total)})"


def _size(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000:
            return f"{num_bytes:.3g} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.3g} TB"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"
