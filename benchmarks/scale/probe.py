"""``tunepod run`` with a stopwatch around each piece of per-trial bookkeeping.

    python -m benchmarks.scale.probe STATS_JSON run SPEC [--set ...]

Wraps (before the CLI starts) the calls a trial costs the orchestrator: Optuna's ask and tell, the
trial's wait for its MLflow run to exist (its job starts with the run's id), the launcher's submit,
and the Prefect task run around each trial (from its submission to the trial's start, plus from the
trial's end to the flow seeing its result); and every MLflow call of the tracker, which the
tracking outbox's threads make beside the trials (the run's creation included). At
exit it writes, as JSON: per piece the number of calls, the summed wall seconds and the summed CPU
seconds of the calling thread (``time.thread_time``: what the call itself computed, without the time
it waited for a core, a lock or a disk; not known for the Prefect task run, which spans threads)
and, of it, the seconds in user space (``RUSAGE_THREAD``: the rest is the kernel's, mostly fsync,
whose cost follows the filesystem's load more than the call's own work), this process's own CPU
seconds (its threads, not the jobs nor Prefect's server), its peak resident memory, and its tail:
the seconds from the last trial's task run settling to the process's exit (the end of the study:
summary, plots, MLflow's last writes, Prefect's artifacts and shutdown).
"""

from __future__ import annotations

import atexit
import functools
import json
import resource
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

_totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
_lock = threading.Lock()
_submitted: dict[int, float] = {}
_ended: dict[int, float] = {}
_last_trial_settled: list[float] = []


def _add(piece: str, seconds: float, cpu_s: float = 0.0, user_s: float = 0.0) -> None:
    with _lock:
        total = _totals[piece]
        total[0] += 1
        total[1] += seconds
        total[2] += cpu_s
        total[3] += user_s


def _user_s() -> float:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_utime


_inside = threading.local()


def _timed(piece: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "piece", None) == piece:
            # A wrapped call made by another (the tracker's find_run searches with its own
            # find_runs): the outer call counts it already.
            return function(*args, **kwargs)
        _inside.piece = piece
        start, start_cpu, start_user = time.perf_counter(), time.thread_time(), _user_s()
        try:
            return function(*args, **kwargs)
        finally:
            _inside.piece = None
            seconds, cpu_s = time.perf_counter() - start, time.thread_time() - start_cpu
            user_s = _user_s() - start_user
            _add(piece, seconds, cpu_s, user_s)
            if piece == "MLflow writes":  # each call apart too: which ones a trial's record costs
                _add(f"MLflow writes: {function.__name__}", seconds, cpu_s, user_s)

    return timed


def _wrap_methods(cls: type, piece: str, names: list[str]) -> None:
    for name in names:
        setattr(cls, name, _timed(piece, getattr(cls, name)))


def _instrument() -> None:
    import tasks.steps
    import tunepod.steps.tune as tune_step
    from tunepod.hpo.trials import StudyTrials
    from tunepod.hpo.tuner import Tuner
    from tunepod.launch.base import LauncherBase
    from tunepod.tracking.mirror import RunMirror
    from tunepod.tracking.mlflow_tracker import MlflowTracker
    from tunepod.tracking.outbox import TrackingOutbox
    from tunepod.tracking.reserve import RunReserve

    _wrap_methods(Tuner, "ask", ["_ask"])
    _wrap_methods(StudyTrials, "tell", ["tell"])
    _wrap_methods(LauncherBase, "submission", ["submit"])
    # A trial's run: taken from those made ahead, or waited for while the outbox creates it.
    _wrap_methods(RunReserve, "MLflow run wait", ["take_into"])
    _wrap_methods(RunMirror, "MLflow run wait", ["wait_for_run"])
    public = [n for n, v in vars(MlflowTracker).items() if callable(v) and not n.startswith("_")]
    _wrap_methods(MlflowTracker, "MLflow writes", public)
    # The tune step's end, after its last trial: each a piece of the tail (the trial set is also
    # read once as the first trial is submitted, for Prefect's trial table: a study with no trials).
    _wrap_methods(TrackingOutbox, "tail: MLflow flush", ["flush"])
    _wrap_methods(Tuner, "tail: trial set", ["trial_set"])
    _wrap_methods(RunReserve, "tail: runs made ahead deleted", ["close"])
    tune_step.record_plots = _timed("tail: plots", tune_step.record_plots)
    tune_step.record_trial_table = _timed("tail: trial table", tune_step.record_trial_table)

    run_trial = Tuner.run_trial

    def timed_trial(self: Tuner, number: int, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        if number in _submitted:
            _add("Prefect task run", started - _submitted.pop(number))
        try:
            return run_trial(self, number, *args, **kwargs)
        finally:
            _ended[number] = time.perf_counter()

    Tuner.run_trial = timed_trial  # type: ignore[method-assign]
    submit_trial = tasks.steps.submit_trial

    def timed_submit(tuner: Tuner, number: int) -> Any:
        _submitted[number] = time.perf_counter()
        future = submit_trial(tuner, number)
        future.add_done_callback(lambda _: _after_trial(number))
        return future

    tasks.steps.submit_trial = timed_submit


def _after_trial(number: int) -> None:
    _last_trial_settled[:] = [time.perf_counter()]
    ended = _ended.pop(number, None)
    if ended is not None:
        _add("Prefect task run", time.perf_counter() - ended)


def _write(path: Path) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    pieces = {
        name: {"calls": int(c), "seconds": s, "cpu_s": cpu, "user_s": user}
        for name, (c, s, cpu, user) in _totals.items()
    }
    tail_s = time.perf_counter() - _last_trial_settled[0] if _last_trial_settled else None
    cpu_s = usage.ru_utime + usage.ru_stime
    figures = {
        "cpu_s": cpu_s,
        "user_s": usage.ru_utime,
        "tail_s": tail_s,
        "max_rss_mb": usage.ru_maxrss / 1024,
    }
    path.write_text(json.dumps({"pieces": pieces, **figures}))


def main() -> None:
    stats = Path(sys.argv[1])
    atexit.register(_write, stats)
    _instrument()
    from tunepod.cli import app

    app(sys.argv[2:], prog_name="tunepod")


if __name__ == "__main__":
    main()
