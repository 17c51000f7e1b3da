"""MLflow runs made ahead of the trials that will write into them.

A trial's job starts once its MLflow run exists (the job gets ``MLFLOW_RUN_ID``), and creating a run
is a round trip to MLflow (a SQLite transaction, an HTTP request) on the trial's path. A tune step
keeps a few runs made in advance instead: children of its pipeline run, tagged ``tunepod.reserved``
and nothing else of a trial. A new trial takes one without asking MLflow anything (a file rename), its
job starts at once, and its mirror gives the run the trial's name, tags and params at its first sync,
in the one write that tags every job's run (``tunepod.tracking.mirror``).

The reserve is a folder beside the study's job dirs, ``<jobs dir>/.mlflow-runs-ahead/<pipeline run
id>/``, one file per run, named after the run and holding its id. Taking a run renames its file into
the trial's job dir (``RESERVED_RUN``):

- a rename is atomic, so two orchestrators of one study never take the same run;
- a crash after the rename, before the job dir's tracking record names the run, leaves the file in the
  job dir, where the trial's next mirror takes the run from (``adopt_reserved_run``);
- a job dir on another filesystem than the reserve cannot take a run by rename: its run is created as
  its trial starts, as without a reserve.

A filler thread keeps ``size`` runs ready, making one whenever one was taken; while MLflow does not
answer it backs off, and trials create their own runs meanwhile. At the step's end (``close``) the
runs nobody took are deleted (MLflow keeps deleted runs out of every search and of the UI). Runs left
by a pipeline run that ended without closing its reserve (a killed orchestrator) are taken over and
deleted by the next reserve opened beside them. One run a crash can leave behind: made, its file not
yet written. ``close`` deletes such runs of its own pipeline run once they are a minute old (a filler
of another orchestrator of the same pipeline run may be about to write the file of a newer one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from tunepod import world
from tunepod.runtime.files import write_bytes_atomic
from tunepod.tracking import tags

logger = logging.getLogger(__name__)

RESERVE_FOLDER = ".mlflow-runs-ahead"
RESERVED_RUN = "mlflow-reserved-run"
"""The file, in a job dir, of the reserved run it took and has not yet named in its tracking record."""
RESERVED_NAME = "reserved"
"""A reserved run's name until a trial takes it."""
ORPHAN_AGE_S = 60.0
"""A reserved run no file names is deleted at ``close`` once this old (by default)."""
FILLER_THREAD = "tunepod-mlflow-runs-ahead"
_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 10.0


def reserved_run_file(job_dir: Path) -> Path:
    return job_dir / RESERVED_RUN


def adopt_reserved_run(job_dir: Path) -> str | None:
    """The run a crashed take left in ``job_dir`` (the caller names it in the tracking record, then
    removes the file with ``forget_reserved_run``); None when there is none."""
    try:
        return reserved_run_file(job_dir).read_text().strip() or None
    except FileNotFoundError:
        return None


def forget_reserved_run(job_dir: Path) -> None:
    reserved_run_file(job_dir).unlink(missing_ok=True)


class MakesRuns(Protocol):
    """What a reserve asks of MLflow (``MlflowTracker`` is one)."""

    def start_run(
        self, name: str, *, parent_run_id: str | None = None, tags: Mapping[str, str] | None = None
    ) -> str: ...

    def delete_run(self, run_id: str) -> None: ...

    def find_runs(self, filter_string: str) -> list[Any]: ...


class RunReserve:
    """Up to ``size`` runs made ahead, children of ``parent_run_id``. Thread safe."""

    def __init__(
        self,
        tracker: MakesRuns,
        jobs_dir: Path,
        parent_run_id: str,
        size: int,
        *,
        orphan_age_s: float = ORPHAN_AGE_S,
    ) -> None:
        self.tracker = tracker
        self.orphan_age_s = orphan_age_s
        self.root = jobs_dir / RESERVE_FOLDER
        self.folder = self.root / parent_run_id
        self.parent_run_id = parent_run_id
        self.size = size
        self.folder.mkdir(parents=True, exist_ok=True)
        self._cond = world.condition()
        self._closed = False
        self._filler_running = True
        world.start_thread(self._fill_until_closed, FILLER_THREAD)

    def take_into(self, job_dir: Path) -> str | None:
        """A reserved run, its file moved to ``job_dir`` (see ``adopt_reserved_run``); None when none is
        ready (or the job dir cannot take one by rename)."""
        target = reserved_run_file(job_dir)
        for name in self._ready_files():
            try:
                os.rename(self.folder / name, target)
            except FileNotFoundError:
                continue  # taken by another orchestrator between the listing and the rename
            except OSError:  # another filesystem (EXDEV), or no such job dir yet
                return None
            with self._cond:
                self._cond.notify_all()  # the filler makes one more
            return adopt_reserved_run(job_dir)
        return None

    def close(self, *, all_named: bool) -> None:
        """Stop making runs and delete those nobody took (best effort: MLflow may not answer).
        ``all_named``: every run a trial took is named (the step's mirrors all caught up): only then
        are the reserved runs no file names orphans (one taken, its trial not synced yet, is not)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._filler_running, timeout=10)
        try:
            self._delete_untaken(self.folder)
            if all_named:
                self._delete_orphans()
        except Exception as exc:  # MLflow's errors are many; none of them fails a step that tuned
            logger.warning("the MLflow runs made ahead of trials were not all deleted: %s", exc)

    # ------------------------------------------------------------------------------------ the filler

    def _fill_until_closed(self) -> None:
        try:
            self._take_over_left_behind()
            backoff = _FIRST_BACKOFF_S
            while self._wait_for_room():
                try:
                    self._make_one()
                    backoff = _FIRST_BACKOFF_S
                except Exception as exc:  # MLflow does not answer: trials create their own runs
                    logger.debug("no MLflow run made ahead: %s", exc)
                    with self._cond:
                        self._cond.wait_for(lambda: self._closed, timeout=backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF_S)
        finally:
            with self._cond:
                self._filler_running = False
                self._cond.notify_all()

    def _wait_for_room(self) -> bool:
        """Wait until the reserve has room for one more run; False once closed."""
        with self._cond:
            while not self._closed and len(self._ready_files()) >= self.size:
                self._cond.wait(timeout=5.0)  # another orchestrator of the run may take one too
            return not self._closed

    def _make_one(self) -> None:
        run_id = self.tracker.start_run(
            RESERVED_NAME, parent_run_id=self.parent_run_id, tags={tags.RESERVED: "true"}
        )
        write_bytes_atomic(self.folder / f"{run_id}.run", run_id.encode())

    def _ready_files(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return sorted(name for name in os.listdir(self.folder) if name.endswith(".run"))
        return []

    # ------------------------------------------------------------------------------------ clean-up

    def _take_over_left_behind(self) -> None:
        """Delete the runs of other pipeline runs' reserves: theirs ended without closing (a killed
        orchestrator), or are open and make more (each run deleted is first taken, by rename)."""
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                if entry.is_dir() and entry.name != self.folder.name:
                    self._delete_untaken(Path(entry.path))
                    with contextlib.suppress(OSError):
                        os.rmdir(entry.path)

    def _delete_untaken(self, folder: Path) -> None:
        for name in sorted(os.listdir(folder)) if folder.is_dir() else []:
            if not name.endswith(".run"):
                continue
            taken = folder / f".deleting-{uuid.uuid4().hex}"
            try:
                os.rename(folder / name, taken)
            except FileNotFoundError:
                continue
            try:
                self.tracker.delete_run(taken.read_text().strip())
            except Exception:
                os.rename(taken, folder / name)  # still in MLflow: a later clean-up deletes it
                raise
            taken.unlink()

    def _delete_orphans(self) -> None:
        """Reserved runs of this pipeline run that no file names: made by a filler that died before
        it wrote the file."""
        named = {name.removesuffix(".run") for name in self._ready_files()}
        too_new = int((world.time() - self.orphan_age_s) * 1000)
        for run in self.tracker.find_runs(
            f"tags.`{tags.RESERVED}` = 'true' AND tags.`{tags.PARENT_RUN}` = '{self.parent_run_id}' "
            f"AND attributes.start_time < {too_new}"
        ):
            if run.info.run_id not in named:
                self.tracker.delete_run(run.info.run_id)
