"""Run jobs as local ``torchrun`` processes: the launcher for a laptop, CI and a single machine.

Each job is ``/bin/sh -c WRAPPER`` around ``python -m torch.distributed.run --standalone ...``, started
in a session of its own. The wrapper writes the command's exit code to ``JobPaths.exit_code`` (temp
file, then rename) once the command has exited, so the outcome can be read by anyone later, including
an orchestrator that restarted and was never the parent of the job.

Which processes belong to a job: torchrun starts its workers in sessions of their own (torch's
``SubprocessHandler`` passes ``start_new_session=True``), so the wrapper's process group does NOT hold
them. Every process of a job instead inherits ``TUNEPOD_LOCAL_JOB_TOKEN``, a random token unique to
one submission, and ``cancel`` finds the job's processes by that token (or by the wrapper's process
group) in ``/proc``. This module is therefore Linux only.

``Resources.timeout_min`` is not enforced here: the caller enforces it by cancelling the job
(``tunepod.launch.watch.watch(timeout_s=...)``), the same way for every backend that has no limit of
its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from tunepod.errors import JobError
from tunepod.launch.base import JobSpec, JobState
from tunepod.launch.paths import JobPaths, tail_lines
from tunepod.runtime.files import write_bytes_atomic

logger = logging.getLogger(__name__)

TOKEN_ENV = "TUNEPOD_LOCAL_JOB_TOKEN"
"""Environment variable every process of a local job inherits; its value identifies the submission."""

_JOB_ID = re.compile(r"^local-(?P<pid>\d+)-(?P<start>\d+)$")
_POLL_S = 0.05
# After SIGKILL the kernel only has to tear processes down; a job still there after this long is stuck
# in uninterruptible sleep (a hung filesystem), which the caller must hear about.
_AFTER_KILL_WAIT_S = 10.0
_DEAD_STATES = frozenset({"Z", "X", "x"})

# "$1"/"$2" are the exit-code paths, the rest is the command: passed as arguments, nothing is quoted.
# The trap has a handler (not ""), so the shell outlives a cancel's SIGTERM and still records the exit
# code, while the command itself gets default signal handling back. `command -p` finds mv even if the
# job's environment replaced PATH.
_WRAPPER_SCRIPT = """trap : TERM INT
exit_tmp=$1
exit_final=$2
shift 2
"$@"
code=$?
printf '%s\\n' "$code" > "$exit_tmp" && command -p mv -f "$exit_tmp" "$exit_final"
exit "$code"
"""


def torchrun_argv(job: JobSpec, python: str) -> list[str]:
    """The command that runs ``job`` on this machine (pure): ``procs_per_node`` processes under torchrun."""
    nproc = str(job.resources.procs_per_node)
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc]
    return [*command, str(job.entrypoint), *job.args]


def wrapper_argv(paths: JobPaths, command: list[str]) -> list[str]:
    """``command`` wrapped in the shell that records its exit code under ``paths`` (pure)."""
    exit_tmp = paths.exit_code.with_name(paths.exit_code.name + ".tmp")
    return ["/bin/sh", "-c", _WRAPPER_SCRIPT, "tunepod-job", str(exit_tmp), str(paths.exit_code), *command]


@dataclass(frozen=True)
class ProcessStat:
    """The few fields of ``/proc/<pid>/stat`` this module needs."""

    state: str
    pgid: int
    start_ticks: int
    """Field 22: start time in clock ticks after boot. With the pid, it identifies one process."""

    @property
    def is_dead(self) -> bool:
        """A zombie has exited; only its parent has not collected the exit status yet."""
        return self.state in _DEAD_STATES


def read_process_stat(pid: int) -> ProcessStat | None:
    """``/proc/<pid>/stat`` parsed, or None when no such process exists (or it cannot be read)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and parentheses.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return ProcessStat(state=fields[0].decode(), pgid=int(fields[2]), start_ticks=int(fields[19]))


@dataclass(frozen=True)
class Submission:
    """What ``submit`` records in ``JobPaths.submission`` so a later process can attach to the job."""

    job_id: str
    """``local-<pid>-<start_ticks>``: unique on this machine even after the pid is reused."""
    name: str
    pid: int
    """The wrapper shell, leader of its own session and process group."""
    pgid: int
    start_ticks: int
    """Field 22 of the wrapper's ``/proc/<pid>/stat``: tells our wrapper from a later process with its pid."""
    token: str
    """The value of ``TOKEN_ENV`` that every process of the job inherits."""
    argv: list[str]
    submitted_at: str

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2).encode()

    @classmethod
    def read(cls, path: Path) -> Submission:
        data = json.loads(path.read_text())
        return cls(**{key: data[key] for key in cls.__dataclass_fields__})


class LocalJob:
    """A job running (or once run) on this machine.

    Thread safety: ``state``, ``logs``, ``exit_code`` and ``cancel`` may be called from several
    threads at once; concurrent ``cancel`` calls are serialized and all return once the job is gone.
    """

    def __init__(
        self,
        submission: Submission,
        job_dir: Path,
        *,
        cancel_grace_s: float,
        process: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.job_id = submission.job_id
        self.job_dir = job_dir
        self.submission = submission
        self.cancel_grace_s = cancel_grace_s
        self._process = process
        self._paths = JobPaths(job_dir)
        self._cancel_lock = threading.Lock()

    def state(self) -> JobState:
        """RUNNING while the wrapper lives; then CANCELLED, SUCCEEDED or FAILED from the job's files."""
        if self._wrapper_alive():
            return JobState.RUNNING
        if self._paths.cancelled.exists():
            return JobState.CANCELLED
        return JobState.SUCCEEDED if self.exit_code == 0 else JobState.FAILED

    @property
    def exit_code(self) -> int | None:
        """The command's exit code; None while it runs or when the wrapper itself was killed."""
        try:
            return int(self._paths.exit_code.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def describe(self) -> str:
        """One line on how the job ended, for error messages."""
        code = self.exit_code
        if code is None:
            return f"local job {self.job_id}: no exit code (the job's wrapper was killed)"
        return f"local job {self.job_id}: exit code {code}"

    def cancel(self) -> None:
        """Mark the job cancelled, SIGTERM it, SIGKILL what is left after ``cancel_grace_s``.

        Returns once no process of the job is left; raises ``JobError`` if some survive SIGKILL.
        Idempotent. Cancelling a job that has already ended changes nothing: it keeps its real outcome.
        """
        with self._cancel_lock:
            if not self.pids():
                self._reap()
                return
            write_bytes_atomic(self._paths.cancelled, f"cancelled at {_now()}\n".encode())
            self._signal_all(signal.SIGTERM)
            if self._wait_until_gone(self.cancel_grace_s):
                return
            logger.warning(
                "job %s ignored SIGTERM for %.1fs; sending SIGKILL", self.job_id, self.cancel_grace_s
            )
            self._signal_all(signal.SIGKILL)
            if not self._wait_until_gone(_AFTER_KILL_WAIT_S):
                raise JobError(
                    f"local job {self.job_id} still has processes {self.pids()} {_AFTER_KILL_WAIT_S:.0f}s "
                    f"after SIGKILL (stuck in the kernel, e.g. on a hung filesystem); job dir: {self.job_dir}"
                )

    def logs(self, tail: int = 50) -> str:
        """The last ``tail`` lines of stderr (where torchrun and workers write tracebacks), else stdout."""
        return tail_lines(self._paths.stderr, tail) or tail_lines(self._paths.stdout, tail)

    def pids(self) -> list[int]:
        """The live processes of this job: the wrapper, torchrun, its workers and their children."""
        leader_is_ours = self._wrapper_alive()
        return [pid for pid, stat in _live_processes() if self._owns(pid, stat, leader_is_ours)]

    def _owns(self, pid: int, stat: ProcessStat, leader_is_ours: bool) -> bool:
        # The process group only counts while its leader is our wrapper: once the leader is gone, the
        # group id could name a stranger's group after pid reuse. The token never can.
        if leader_is_ours and stat.pgid == self.submission.pgid:
            return True
        return _has_token(pid, self.submission.token)

    def _wrapper_alive(self) -> bool:
        if self._process is not None:
            return self._process.poll() is None
        stat = read_process_stat(self.submission.pid)
        # A reused pid has another start time; a zombie has exited and waits for its parent.
        return stat is not None and stat.start_ticks == self.submission.start_ticks and not stat.is_dead

    def _signal_all(self, signum: signal.Signals) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                continue

    def _wait_until_gone(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self._reap()
            if not self.pids():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)

    def _reap(self) -> None:
        # Collect the wrapper's exit status when we are its parent, so no zombie of ours lingers.
        if self._process is not None:
            self._process.poll()


class LocalLauncher:
    """Starts jobs as ``torchrun --standalone`` process trees on this machine.

    ``root`` stands in for the shared filesystem (``fsx:///x`` resolves to ``root/x``). Resources a
    single machine cannot honour are logged once per launcher, not per job. Thread safety: ``submit``
    and ``attach`` may be called from several threads.
    """

    kind = "local"

    def __init__(self, root: Path, cancel_grace_s: float = 10.0, python: str = sys.executable) -> None:
        self.root = root
        self.cancel_grace_s = cancel_grace_s
        self.python = python
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()

    def submit(self, job: JobSpec) -> LocalJob:
        """Start ``job`` and record ``submission.json``. Clears a previous run's outcome files in the
        same ``job_dir`` (logs are appended to, checkpoints kept), so a crashed job can be resumed."""
        self._warn_ignored_resources(job)
        paths = job.paths
        paths.job_dir.mkdir(parents=True, exist_ok=True)
        _refuse_if_running(paths, self.cancel_grace_s)
        _clear_previous_outcome(paths)
        token = secrets.token_hex(16)
        argv = wrapper_argv(paths, torchrun_argv(job, self.python))
        process = _start(argv, paths, {**os.environ, **job.env, TOKEN_ENV: token})
        submission = _record_submission(job, process, token, argv)
        return LocalJob(submission, paths.job_dir, cancel_grace_s=self.cancel_grace_s, process=process)

    def attach(self, job_id: str, job_dir: Path) -> LocalJob:
        """A handle on a job submitted earlier, by this process or another, from its ``submission.json``."""
        parse_job_id(job_id)
        submission = _read_submission(JobPaths(job_dir))
        if submission.job_id != job_id:
            raise JobError(
                f"cannot attach to local job {job_id}: {JobPaths(job_dir).submission} names job "
                f"{submission.job_id} (the job dir was reused by a later submission); attach to "
                f"{submission.job_id} or check which job dir belongs to {job_id}"
            )
        return LocalJob(submission, job_dir, cancel_grace_s=self.cancel_grace_s)

    def _warn_ignored_resources(self, job: JobSpec) -> None:
        for key, message in _ignored_resources(job).items():
            with self._warn_lock:
                if key in self._warned:
                    continue
                self._warned.add(key)
            logger.warning("local launcher: %s", message)


def _ignored_resources(job: JobSpec) -> dict[str, str]:
    """What a single machine cannot honour in ``job.resources``, keyed by field."""
    res = job.resources
    ignored: dict[str, str] = {}
    if res.num_nodes > 1:
        ignored["num_nodes"] = (
            f"resources.num_nodes={res.num_nodes} ignored: every process runs on this machine "
            f"({res.procs_per_node} in all, torchrun --standalone)"
        )
    gpus_here = _count_nvidia_gpus()
    if res.gpus_per_node > gpus_here:
        ignored["gpus_per_node"] = (
            f"resources.gpus_per_node={res.gpus_per_node} but this machine has {gpus_here} NVIDIA GPU(s); "
            "the job sees only what is here (CPU if none)"
        )
    if res.instance_type is not None:
        ignored["instance_type"] = (
            f"resources.instance_type={res.instance_type!r} ignored: jobs run on this machine"
        )
    return ignored


def _count_nvidia_gpus() -> int:
    # /dev/nvidiaN exists per GPU when the driver is loaded; cheaper than importing torch to ask CUDA.
    return sum(1 for dev in Path("/dev").glob("nvidia*") if dev.name[len("nvidia") :].isdigit())


def _read_submission(paths: JobPaths) -> Submission:
    try:
        return Submission.read(paths.submission)
    except FileNotFoundError:
        raise JobError(
            f"no local job was submitted in {paths.job_dir}: {paths.submission} is missing (never "
            "submitted, or the job dir was moved or cleaned); submit the job again"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise JobError(f"{paths.submission} is unreadable ({exc}); submit the job again") from exc


def _refuse_if_running(paths: JobPaths, cancel_grace_s: float) -> None:
    if not paths.submission.exists():
        return
    previous = LocalJob(_read_submission(paths), paths.job_dir, cancel_grace_s=cancel_grace_s)
    if previous.state() is JobState.RUNNING:
        raise JobError(
            f"job dir {paths.job_dir} belongs to local job {previous.job_id}, which is still running; "
            "cancel it (or wait for it) before submitting again into the same job dir"
        )


def _clear_previous_outcome(paths: JobPaths) -> None:
    exit_tmp = paths.exit_code.with_name(paths.exit_code.name + ".tmp")
    for stale in (paths.exit_code, exit_tmp, paths.cancelled, paths.submission):
        stale.unlink(missing_ok=True)


def _start(argv: list[str], paths: JobPaths, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(paths.stdout, "ab") as stdout, open(paths.stderr, "ab") as stderr:
        # A session of its own: the job outlives the orchestrator and a terminal's Ctrl-C.
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env, start_new_session=True
        )


def _record_submission(
    job: JobSpec, process: subprocess.Popen[bytes], token: str, argv: list[str]
) -> Submission:
    try:
        # The wrapper is our unreaped child, so its pid cannot be reused while we read its stat.
        stat = read_process_stat(process.pid)
        if stat is None:
            raise JobError(f"local job {job.name} vanished right after start; see {job.paths.stderr}")
        submission = Submission(
            job_id=f"local-{process.pid}-{stat.start_ticks}",
            name=job.name,
            pid=process.pid,
            pgid=stat.pgid,
            start_ticks=stat.start_ticks,
            token=token,
            argv=argv,
            submitted_at=_now(),
        )
        write_bytes_atomic(job.paths.submission, submission.to_json())
    except BaseException:
        # Without a submission file nobody could ever find or cancel this job: stop it now.
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    return submission


def parse_job_id(job_id: str) -> tuple[int, int]:
    """``local-<pid>-<start ticks>`` -> (pid, start ticks); raises ``JobError`` for anything else."""
    match = _JOB_ID.match(job_id)
    if match is None:
        raise JobError(f"{job_id!r} is not a local job id (expected local-<pid>-<start ticks>)")
    return int(match["pid"]), int(match["start"])


def _live_processes() -> Iterator[tuple[int, ProcessStat]]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (stat := read_process_stat(int(entry.name))) and not stat.is_dead:
            yield int(entry.name), stat


def _has_token(pid: int, token: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's process: not ours either way
        return False
    return f"\0{TOKEN_ENV}={token}\0".encode() in b"\0" + environ


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
