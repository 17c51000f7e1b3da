"""Following a running job: its state, what it reports, and the runbook when it ends badly."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from tunepod.launch.base import JobHandle, JobState
from tunepod.launch.paths import JobPaths
from tunepod.runtime import Report, read_reports

# Called with the reports that appeared since the last call; returns True to stop (cancel) the job.
ReportHandler = Callable[[list[Report]], bool]

LOG_TAIL_LINES = 20
# How much of a log to read when looking for the worker's own error above torchrun's summary.
LOG_SCAN_LINES = 400
# torchrun's agent prints its own traceback (ending in ChildFailedError) after the worker's; the
# worker's traceback above it is what the user needs to see.
TORCHRUN_SUMMARY = re.compile(
    r"^.*torch/distributed/elastic/multiprocessing/api\.py.*failed \(exitcode", re.MULTILINE
)


@dataclass(frozen=True)
class WatchResult:
    state: JobState
    stopped: bool
    """True when the report handler asked to stop the job (a pruned trial)."""
    timed_out: bool
    last_step: int | None


def watch(
    handle: JobHandle,
    *,
    poll_s: float,
    on_reports: ReportHandler | None = None,
    after_step: int | None = None,
    timeout_s: float | None = None,
) -> WatchResult:
    """Poll ``handle`` until it ends, feeding new reports (step > ``after_step``) to ``on_reports``.

    Reports are read once more after the job ends, so the last epoch is never missed. A job that
    outlives ``timeout_s`` is cancelled.
    """
    paths = JobPaths(handle.job_dir)
    last = after_step
    deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def drain() -> bool:
        nonlocal last
        fresh = [r for r in read_reports(paths.metrics) if last is None or r.step > last]
        if not fresh:
            return False
        last = max(r.step for r in fresh)
        return on_reports(fresh) if on_reports else False

    while True:
        state = handle.state()
        if drain() and not state.is_terminal:
            handle.cancel()
            return WatchResult(handle.state(), stopped=True, timed_out=False, last_step=last)
        if state.is_terminal:
            drain()
            return WatchResult(state, stopped=False, timed_out=False, last_step=last)
        if deadline is not None and time.monotonic() > deadline:
            handle.cancel()
            return WatchResult(handle.state(), stopped=False, timed_out=True, last_step=last)
        time.sleep(poll_s)


def failure_message(what: str, handle: JobHandle, state: JobState, *, kind: str) -> str:
    """A runbook for a job that ended badly: which job, what state, the log tail, where the logs are."""
    paths = JobPaths(handle.job_dir)
    tail = worker_error(handle.logs(LOG_SCAN_LINES), LOG_TAIL_LINES) or "(no output)"
    message = (
        f"{what} ({kind} job {handle.job_id}) ended {state}: {handle.describe()}.\n"
        f"Last {LOG_TAIL_LINES} lines of its log:\n{tail}"
    )
    # Backends whose output is elsewhere (pod logs, CloudWatch) say where in their logs() text.
    if paths.stderr.exists() or paths.stdout.exists():
        message += f"\nFull logs: {paths.stderr} and {paths.stdout}"
    return message


def worker_error(log: str, lines: int) -> str:
    """The last ``lines`` lines of ``log`` before torchrun's own failure summary (the worker's
    traceback), or of the whole log when there is no such summary."""
    starts = [match.start() for match in TORCHRUN_SUMMARY.finditer(log)]
    relevant = log[: starts[-1]] if starts and log[: starts[-1]].strip() else log
    return "\n".join(relevant.rstrip().splitlines()[-lines:])
