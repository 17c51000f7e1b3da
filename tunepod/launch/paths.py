"""Every path a job and its orchestrator agree on, built in one place.

The job directory lives on the shared filesystem (FSx for Lustre on a cluster, a folder locally), so
the orchestrator can read what the job wrote and a restarted orchestrator can find it again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tunepod.errors import TunepodError
from tunepod.runtime.progress import PROGRESS_DIR_NAME
from tunepod.runtime.restores import RESTORES_FILE_NAME
from tunepod.runtime.worlds import WORLDS_FILE_NAME

SHARED_SCHEME = "fsx://"


@dataclass(frozen=True)
class JobPaths:
    """The files of one job under its ``job_dir``. Which side writes each one is stated per field."""

    job_dir: Path

    @property
    def stdout(self) -> Path:
        """Written by the backend: the job's standard output."""
        return self.job_dir / "stdout.log"

    @property
    def stderr(self) -> Path:
        """Written by the backend: the job's standard error."""
        return self.job_dir / "stderr.log"

    @property
    def checkpoints(self) -> Path:
        """Written by rank 0 of the job: ``step-N`` checkpoint folders."""
        return self.job_dir / "checkpoints"

    @property
    def metrics(self) -> Path:
        """Appended by rank 0 of the job: one JSON object per report, read by the pruner."""
        return self.job_dir / "metrics.jsonl"

    @property
    def result(self) -> Path:
        """Written once, atomically, by rank 0 when the job finishes well."""
        return self.job_dir / "result.json"

    @property
    def progress(self) -> Path:
        """Written by every rank of the job: ``rank-N.json`` heartbeats (``tunepod.runtime.progress``)."""
        return self.job_dir / PROGRESS_DIR_NAME

    @property
    def restores(self) -> Path:
        """Appended by rank 0 of a job with checkpoint tiers: where each restore came from
        (``tunepod.runtime.restores``)."""
        return self.job_dir / RESTORES_FILE_NAME

    @property
    def worlds(self) -> Path:
        """Appended by rank 0: each world size the job ran with (``tunepod.runtime.worlds``)."""
        return self.job_dir / WORLDS_FILE_NAME

    @property
    def running(self) -> Path:
        """Written by the driver holding the job dir's lease: when the current job started running."""
        return self.job_dir / "running.json"

    @property
    def earlier_runs(self) -> Path:
        """Written by the driver holding the job dir's lease: which ranks' heartbeats are of runs that
        are over (``tunepod.launch.watchdog``)."""
        return self.job_dir / "earlier_runs.json"

    @property
    def submission(self) -> Path:
        """Written by the launcher at submit: what it needs to re-attach after a restart."""
        return self.job_dir / "submission.json"

    @property
    def exit_code(self) -> Path:
        """Written by the local launcher's wrapper when the job's main process exits."""
        return self.job_dir / "exit_code"

    @property
    def cancelled(self) -> Path:
        """Written by the orchestrator before it cancels the job, so a later reader knows why it ended."""
        return self.job_dir / "cancelled"

    @property
    def lease(self) -> Path:
        """Written by the orchestrator that drives the job, renewed while it lives (see ``lease.py``)."""
        return self.job_dir / "lease.json"

    @property
    def lease_lock(self) -> Path:
        """Locked around every read-modify-write of the lease."""
        return self.job_dir / ".lease.lock"

    @property
    def tracking(self) -> Path:
        """Written by the orchestrator: how far the job's MLflow run is brought up to date."""
        return self.job_dir / "mlflow.json"

    @property
    def tracking_lock(self) -> Path:
        """Held while the job's MLflow run is looked up or created: one run per job dir."""
        return self.job_dir / ".mlflow.lock"


@dataclass(frozen=True)
class SharedRoot:
    """Resolves ``fsx:///some/path`` against the shared filesystem root of a launcher."""

    root: Path

    def resolve(self, uri: str) -> Path:
        """``fsx:///datasets/x`` -> ``<root>/datasets/x``; any other string is a plain local path.

        Raises ``TunepodError`` for an ``fsx://`` path with a ``..`` in it: it would leave the root."""
        if uri.startswith(SHARED_SCHEME):
            rest = uri[len(SHARED_SCHEME) :]
            # fsx:///path (empty authority) is the launcher's own file system; an explicit file system
            # id (fsx://fs-0123/path) is for the AWS stager and means the same path on the cluster.
            relative = rest.split("/", 1)[1] if "/" in rest else ""
            if ".." in relative.split("/"):
                raise TunepodError(f"{uri!r} leaves the launcher root {self.root}; fix: remove its '..'")
            return (self.root / relative).resolve()
        return Path(uri).expanduser().resolve()

    def jobs_dir(self, group: str, *below: str) -> Path:
        """Where the job directories of one study (``group``) or pipeline live, or, with ``below``
        (a step, a job's key), the folders under it: each name one folder, checked here too (the spec
        refuses such names, but a path joined from a name is where a ``..`` would escape).

        Raises ``TunepodError`` for a name that is not one plain folder name (``..``, ``a/b``, ``/x``)."""
        folder = self.root.resolve() / "jobs"
        for name in (group, *below):
            folder = folder / _one_folder(name)
        return folder


def _one_folder(name: str) -> str:
    """``name`` when it names one folder inside its parent; else ``TunepodError``."""
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise TunepodError(
            f"{name!r} cannot name a folder of job dirs: it would not be one folder under <root>/jobs "
            "(a study, pipeline or step name in the spec); fix: rename it: not '.' or '..', without "
            "'/' or '\\'"
        )
    return name


def tail_lines(path: Path, lines: int) -> str:
    """The last ``lines`` lines of ``path`` ("" if missing), reading only the end of a large file."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            chunk = 64 * 1024
            while True:
                start = max(0, size - chunk)
                handle.seek(start)
                data = handle.read()
                if data.count(b"\n") > lines or start == 0:
                    break
                chunk *= 4
    except FileNotFoundError:
        return ""
    text = data.decode("utf-8", errors="replace").rstrip("\n")
    return "\n".join(text.splitlines()[-lines:]) if lines > 0 else ""


def file_logs(paths: JobPaths, tail: int) -> str:
    """The last ``tail`` lines of a job's stderr (where torchrun and workers write tracebacks), else
    of its stdout: the logs of a backend that writes them into the job dir."""
    return tail_lines(paths.stderr, tail) or tail_lines(paths.stdout, tail)
