"""Per-rank heartbeats: how the orchestrator tells a hung job from a slow one.

Every rank of a job runs one daemon thread that rewrites ``progress/rank-<N>.json`` (beside the
metrics file) every ``TUNEPOD_HEARTBEAT_S`` seconds. The file says when the thread last wrote
(``beat_at``: the process is alive) and when the training loop last advanced (``advanced_at``: it
called ``report``, ``save_checkpoint``, ``load_latest_checkpoint`` or ``heartbeat``). A loop stuck in
a collective, or on a hung mount, stops advancing while its thread keeps beating; a killed or frozen
process stops beating too. Times are the job host's wall clock (``time.time()``), so an orchestrator
that restarts, or runs on another host, reads the same history.

The same file carries the rank's speed (``telemetry``), once its loop calls ``ctx.step_done``: the mean
wall-clock time per step, samples and tokens per second over the steps that ended since the previous
write, and the process's peak memory (CUDA's peak allocation when the process uses CUDA, its peak RSS
otherwise). ``step_done`` only adds to counters in memory; the thread that writes the heartbeat anyway
turns them into the window's figures, so measuring costs no extra write.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, NamedTuple

from tunepod.runtime.files import write_bytes_atomic

HEARTBEAT_S_ENV = "TUNEPOD_HEARTBEAT_S"
PROGRESS_LOG_S_ENV = "TUNEPOD_PROGRESS_LOG_S"
"""Set (by a launcher whose backend watches logs for hangs, HyperPod EKS): print a progress line at
start and then at most this often while the loop advances. Unset: print nothing."""
PROGRESS_LOG_PREFIX = "tunepod progress:"
DEFAULT_HEARTBEAT_S = 10.0
PROGRESS_DIR_NAME = "progress"


@dataclass(frozen=True)
class StepTelemetry:
    """One rank's speed over its last window of steps (the steps that ended between two heartbeat
    writes; when none did, the previous window's figures), and its peak memory when written."""

    step: int
    """The last step of the window (as the loop named it in ``step_done``)."""
    steps: int
    """Steps measured in the window."""
    step_time_s: float
    """Mean wall-clock seconds from one ``step_done`` to the next, over the window."""
    samples_per_s: float | None
    """Samples over the window's seconds; None when the loop never passed ``samples``."""
    tokens_per_s: float | None
    """Tokens over the window's seconds; None when the loop never passed ``tokens``."""
    peak_memory_bytes: int | None
    """CUDA's peak allocation (the largest over the devices this process allocated on) when the
    process uses CUDA, else the process's peak resident set size; None where neither is known."""
    memory: str | None
    """What ``peak_memory_bytes`` measures: ``cuda`` or ``rss``."""
    measured_at: float
    """Wall-clock time of the window's last step."""
    cpu_busy: float | None = None
    """CPU seconds of the thread that calls ``step_done`` (the training loop) per wall second, over
    the window. Ranks in lockstep (DDP, FSDP) share one step time, the slowest rank's, so step time
    cannot show which rank is slow; this can where waiting is off the CPU (gloo on CPU jobs: the
    others wait in the collective, the slow rank computes): the rank near 1 is the one they wait for.
    On GPU jobs the thread mostly waits for the device; there the GPU's own activity (DCGM) tells."""


@dataclass(frozen=True)
class RankProgress:
    """One rank's last heartbeat."""

    rank: int
    host: str
    pid: int
    started_at: float
    """When this process's heartbeat began (``runtime.init``)."""
    beat_at: float
    """When the heartbeat thread last wrote: the process was alive then."""
    advanced_at: float
    """When the training loop last advanced."""
    step: int | None
    """The last step the loop named (a report, a checkpoint, ``heartbeat(step)``)."""
    interval_s: float
    """How often this rank beats: a ``beat_at`` older than a few intervals means the process is gone."""
    finished: bool = False
    """The rank's loop is over (``finish`` was called, or the process is exiting)."""
    stop_signal: str | None = None
    """The signal that asked this rank to stop (``SIGTERM``), when its script was listening for one
    (``ctx.should_stop()``): a rank that ended after it was stopped, not one that failed."""
    stop_requested_at: float | None = None
    telemetry: StepTelemetry | None = None
    """The rank's speed and memory, once its loop called ``ctx.step_done``; None before, and for a
    script that never calls it (the key is then left out of the file)."""
    idle_s: float | None = None
    """Seconds from the loop's last advance to this beat, on the rank's monotonic clock: unlike
    ``beat_at - advanced_at``, no step of the node's wall clock (NTP, a VM resumed) between the two
    counts as idleness. None in a beat of a runtime that did not write it."""
    ran_s: float | None = None
    """Seconds from ``started_at`` to this beat, on the rank's monotonic clock (as ``idle_s``)."""


def progress_dir(metrics_file: Path) -> Path:
    """Where a job's ranks write their heartbeats: beside its metrics file."""
    return metrics_file.parent / PROGRESS_DIR_NAME


def heartbeat_interval_s(environ: Mapping[str, str]) -> float:
    interval = _seconds(environ, HEARTBEAT_S_ENV)
    return DEFAULT_HEARTBEAT_S if interval is None else interval


def progress_log_s(environ: Mapping[str, str]) -> float | None:
    return _seconds(environ, PROGRESS_LOG_S_ENV)


def _seconds(environ: Mapping[str, str], name: str) -> float | None:
    raw = environ.get(name, "")
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"{name}={raw!r} must be above 0")
    return seconds


def peak_memory() -> tuple[int | None, str]:
    """This process's peak memory and what it measures: CUDA's peak allocation (``cuda``) once the
    process has initialized CUDA, else its peak resident set size (``rss``; None where it cannot be
    read). torch is looked up, not imported: a script that uses CUDA has imported it."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        try:
            # Allocator statistics live on the host: reading a device this process never used
            # reads zeros and creates no context on it.
            return max(cuda.max_memory_allocated(device) for device in range(cuda.device_count())), "cuda"
        except (RuntimeError, ValueError):
            pass
    return peak_rss(), "rss"


def peak_rss() -> int | None:
    """This process's peak resident set size in bytes: Linux's ``VmHWM``, which starts afresh at
    ``exec`` (``getrusage``'s ``ru_maxrss`` keeps the peak of the process that forked it, such as
    torchrun's agent with torch loaded), else ``ru_maxrss``; None where neither exists."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss * (1 if sys.platform == "darwin" else 1024)  # Linux counts KiB, macOS bytes


class _Totals(NamedTuple):
    """What a rank's loop measured since it started; replaced whole at every step, so the writing
    thread always reads one consistent set without a lock."""

    steps: int = 0
    seconds: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0
    has_samples: bool = False
    has_tokens: bool = False
    step: int = 0
    at: float = 0.0
    cpu_seconds: float = 0.0
    cpu_at: float = 0.0
    """``time.perf_counter()`` of the last step."""


class StepMeter:
    """Wall time, samples and tokens between one ``step_done`` and the next, summed; ``window``
    turns what accumulated since its last call into a ``StepTelemetry``.

    ``step_done`` is called from the training loop: two clock reads and one tuple, no lock, no I/O.
    The first call only starts the clock (the time before it is start-up, not a step).
    """

    def __init__(self) -> None:
        self._totals: _Totals | None = None
        self._published = _Totals()
        self._last: StepTelemetry | None = None

    def step_done(self, step: int, samples: float | None = None, tokens: float | None = None) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        totals = self._totals
        if samples is not None:
            samples = _count("samples", samples)
        if tokens is not None:
            tokens = _count("tokens", tokens)
        if totals is None:
            self._totals = _Totals(step=step, at=now, cpu_at=cpu)
            return
        # Positional: this runs every step.
        self._totals = _Totals(
            totals.steps + 1,
            totals.seconds + (now - totals.at),
            totals.samples if samples is None else totals.samples + samples,
            totals.tokens if tokens is None else totals.tokens + tokens,
            totals.has_samples or samples is not None,
            totals.has_tokens or tokens is not None,
            step,
            now,
            totals.cpu_seconds + (cpu - totals.cpu_at),
            cpu,
        )

    def window(self) -> StepTelemetry | None:
        """The steps that ended since the last call (the previous window's figures when none did),
        with the peak memory as of now; None until two steps were measured."""
        totals, published = self._totals, self._published
        if totals is not None and totals.steps > published.steps and totals.seconds > published.seconds:
            steps, seconds = totals.steps - published.steps, totals.seconds - published.seconds
            self._published = totals
            self._last = StepTelemetry(
                step=totals.step,
                steps=steps,
                step_time_s=seconds / steps,
                samples_per_s=(totals.samples - published.samples) / seconds if totals.has_samples else None,
                tokens_per_s=(totals.tokens - published.tokens) / seconds if totals.has_tokens else None,
                peak_memory_bytes=None,
                memory=None,
                measured_at=time.time() - (time.perf_counter() - totals.at),
                cpu_busy=(totals.cpu_seconds - published.cpu_seconds) / seconds,
            )
        if self._last is None:
            return None
        peak, memory = peak_memory()
        return replace(self._last, peak_memory_bytes=peak, memory=memory)


def _count(name: str, value: float) -> float:
    number = float(value)
    if not 0 <= number < math.inf:  # False for NaN too
        raise ValueError(f"{name}={value!r}: pass the number of {name} in this step (0 or more)")
    return number


class Heartbeat:
    """The beating thread of one rank. ``advance`` is what the training loop calls: two attribute
    writes, cheap enough for every batch."""

    def __init__(self, folder: Path, rank: int, interval_s: float, log_every_s: float | None = None) -> None:
        now = time.time()
        self._log_every_s = log_every_s
        self._logged: tuple[float, float] | None = None  # (when, the advance it told of)
        self._file = folder / f"rank-{rank}.json"
        self._interval_s = interval_s
        self._rank = rank
        self._started_at = now
        self._advanced_at = now
        # The same two moments on the monotonic clock: what idle_s and ran_s are measured with.
        self._started_mono = self._advanced_mono = time.monotonic()
        self._step: int | None = None
        self._finished = False
        self._stop_signal: str | None = None
        self._stop_requested_at: float | None = None
        self._meter = StepMeter()
        self._stopped = threading.Event()
        # One write at a time, each built under the lock: the final "finished" beat is always last.
        self._writing = threading.Lock()
        self._thread = threading.Thread(target=self._beat, name=f"tunepod-heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._write()  # the first beat before the thread starts: the job is seen alive at once
        self._log_progress()
        self._thread.start()
        # A rank that returns from its script without calling finish (evaluation-only ranks, an
        # early exit) must not look hung while the others carry on.
        atexit.register(self.finish)
        return self

    def advance(self, step: int | None = None) -> None:
        self._advanced_at = time.time()
        self._advanced_mono = time.monotonic()
        if step is not None:
            self._step = step

    def step_done(self, step: int, samples: float | None = None, tokens: float | None = None) -> None:
        """One training step ended: an advance, and a step the meter times (see ``StepMeter``)."""
        self.advance(step)
        self._meter.step_done(step, samples, tokens)

    def stop_requested(self, signal_name: str, at: float) -> None:
        """Called from a signal handler: no lock here (the loop may hold it); the next beat says it."""
        self._stop_signal = signal_name
        self._stop_requested_at = at

    def finish(self) -> None:
        """The loop is over: one last beat says so, and the thread stops. Idempotent."""
        if self._finished:
            return
        self._finished = True
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._write()

    def _beat(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self._log_progress()
            try:
                self._write()
            except OSError:
                # A full or unreachable disk must not kill training; missed beats show as a stall.
                continue

    def _log_progress(self) -> None:
        """One line on stdout for a backend that watches logs: at start, then while the loop advances
        (never more often than ``log_every_s``); a stuck loop prints nothing, and that silence is what
        the backend's rule (``expectedRecurringFrequencyInSeconds``) detects."""
        if self._log_every_s is None:
            return
        now, advanced_at = time.time(), self._advanced_at
        if self._logged is not None:
            logged_at, told_of = self._logged
            if advanced_at == told_of or now - logged_at < self._log_every_s:
                return
        self._logged = (now, advanced_at)
        step = "-" if self._step is None else self._step
        print(f"{PROGRESS_LOG_PREFIX} rank {self._rank} step {step}", flush=True)

    def _write(self) -> None:
        with self._writing:
            mono = time.monotonic()
            beat = RankProgress(
                rank=self._rank,
                host=socket.gethostname(),
                pid=os.getpid(),
                started_at=self._started_at,
                beat_at=time.time(),
                advanced_at=self._advanced_at,
                step=self._step,
                interval_s=self._interval_s,
                finished=self._finished,
                stop_signal=self._stop_signal,
                stop_requested_at=self._stop_requested_at,
                telemetry=self._meter.window(),
                idle_s=mono - self._advanced_mono,
                ran_s=mono - self._started_mono,
            )
            record = asdict(beat)
            if beat.telemetry is None:
                del record["telemetry"]  # a script that never measures writes the file as before
            self._file.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(self._file, json.dumps(record).encode())


def forget_ranks_from(folder: Path, world_size: int) -> None:
    """Rank 0: remove the heartbeat files of ranks ``world_size`` and above. An elastic job whose
    group re-formed with fewer nodes keeps running with fewer ranks; the lost ranks' last beats would
    grow idle and make the orchestrator's watchdog stop the job as hung."""
    for path in folder.glob("rank-*.json") if folder.is_dir() else []:
        number = path.name[len("rank-") : -len(".json")]
        if number.isdigit() and int(number) >= world_size:
            path.unlink(missing_ok=True)


def read_progress(folder: Path) -> list[RankProgress]:
    """Every rank's last heartbeat under ``folder`` (a job's ``progress`` dir), by rank; files being
    replaced or unreadable are left out (the next read sees them)."""
    found: list[RankProgress] = []
    for path in sorted(folder.glob("rank-*.json")) if folder.is_dir() else []:
        try:
            found.append(_beat_of(json.loads(path.read_bytes())))
        except (OSError, ValueError, TypeError, AttributeError):
            continue
    return sorted(found, key=lambda beat: beat.rank)


def _beat_of(raw: dict[str, Any]) -> RankProgress:
    """A beat from its JSON; keys this version does not know (a newer runtime's) are left out."""
    beat = _known(RankProgress, raw)
    telemetry = beat.get("telemetry")
    if telemetry is not None:
        beat["telemetry"] = StepTelemetry(**_known(StepTelemetry, telemetry))
    return RankProgress(**beat)


def _known(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    names = {field.name for field in fields(cls)}
    return {key: value for key, value in raw.items() if key in names}
