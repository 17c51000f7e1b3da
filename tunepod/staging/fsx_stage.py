"""FSx for Lustre as a stage target and an export destination, built on the calls of ``fsx.py``.

``stage_fsx`` makes an S3 prefix appear under ``fsx://<file-system-id>/<path>``: it ensures a data
repository association links ``<path>`` to the prefix (created once, then reused), runs an
``IMPORT_METADATA_FROM_REPOSITORY`` task for ``<path>`` and walks ``<mount>/<path>`` for the counts.
FSx imports metadata only: files are listed with their sizes at once and their contents load from S3
on first read (or when preloaded with ``lfs hsm_restore``, see ``preload_job``), so the walk reads
no data. Nothing is written into the linked folder: a manifest there would be a file S3 lacks.

``export_folders`` sends folders of the file system (checkpoints) to S3: ONE association links a
stable root (the launcher's jobs folder) to an S3 prefix for every run, since FSx allows only a few
associations per file system; then ``EXPORT_TO_REPOSITORY`` and, when asked,
``RELEASE_DATA_FROM_FILESYSTEM`` run on the folders.

The client is ``boto3.client("fsx", region_name=...)`` unless one is given; botocore honours
``AWS_ENDPOINT_URL_FSX`` and the rest of the standard AWS configuration. Functions share no state.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunepod.errors import TunepodError
from tunepod.spec.models import FSX_FILE_SYSTEM_ID, FsxStageSpec
from tunepod.staging.fsx import (
    Association,
    TaskReport,
    ensure_association,
    export_to_repository,
    import_metadata,
    release_from_file_system,
)
from tunepod.staging.s3 import INSTALL_HINT, parse_s3_uri

logger = logging.getLogger(__name__)

MAX_TASK_PATHS = 100
"""FSx accepts at most this many paths in one data repository task."""
_TARGET = re.compile(rf"fsx://(?P<id>{FSX_FILE_SYSTEM_ID})(?P<path>/.*[^/])/?")


@dataclass(frozen=True)
class FsxTarget:
    """``fsx://<file-system-id>/<path>``: a folder inside one FSx file system."""

    file_system_id: str
    path: str
    """The folder inside the file system, from its root: ``/datasets/digits``."""

    @classmethod
    def parse(cls, uri: str) -> FsxTarget:
        """Raises ``TunepodError`` for anything but ``fsx://fs-<hex>/<path>`` (the spec checks it first)."""
        match = _TARGET.fullmatch(uri)
        if match is None or ".." in match["path"].split("/"):
            raise TunepodError(
                f"{uri!r} is not an FSx folder; fix: write it as fsx://fs-0123456789abcdef0/<path>"
            )
        return cls(match["id"], match["path"])

    def local(self, mount: Path) -> Path:
        """Where the folder is on a machine that mounts the file system at ``mount``."""
        return mount.expanduser().resolve() / self.path.lstrip("/")


@dataclass(frozen=True)
class FsxStageReport:
    """What one ``stage_fsx`` run linked, imported and found."""

    target: Path
    association: Association
    import_task: TaskReport
    num_files: int
    num_bytes: int
    seconds: float


@dataclass(frozen=True)
class FsxExportReport:
    """What one ``export_folders`` run sent to S3, and where each folder went."""

    association: Association
    export_tasks: list[TaskReport]
    release_tasks: list[TaskReport]
    s3_uris: dict[Path, str]


def fsx_client(region: str | None = None) -> Any:
    """A boto3 ``fsx`` client; raises ``TunepodError`` naming the extra to install when boto3 is missing."""
    try:
        import boto3  # type: ignore[import-untyped]
    except ImportError as exc:
        raise TunepodError(f"FSx for Lustre targets need boto3; fix: {INSTALL_HINT}") from exc
    return boto3.client("fsx", region_name=region)


def stage_fsx(
    source_uri: str, target: FsxTarget, settings: FsxStageSpec, mount: Path, *, client: Any = None
) -> FsxStageReport:
    """Link ``source_uri`` (``s3://bucket/prefix/``) at ``target`` and import its metadata.

    Raises ``TunepodError`` when the path is linked to another prefix (naming both), the association
    is FAILED/MISCONFIGURED or the import task fails (with AWS's details); ``TransientError`` on a
    timeout or an association being deleted. The files appear under ``target.local(mount)``.
    """
    started = time.monotonic()
    fsx = client if client is not None else fsx_client(settings.region)
    prefix = parse_s3_uri(source_uri).uri
    association = ensure_association(
        fsx,
        target.file_system_id,
        target.path,
        prefix,
        auto_import_events=settings.auto_import,
        poll_s=settings.poll_s,
        timeout_s=settings.timeout_s,
    )
    task = import_metadata(
        fsx,
        target.file_system_id,
        [target.path],
        report_path=settings.report_path,
        poll_s=settings.poll_s,
        timeout_s=settings.timeout_s,
    )
    folder = target.local(mount)
    num_files, num_bytes = _walk_counts(folder)
    if num_files == 0:
        raise TunepodError(
            f"FSx {target.file_system_id} imported {prefix} but {folder} holds no files: the prefix is "
            f"empty, or the file system is not mounted at {mount}; fix: check the stage step's source "
            "and its fsx.mount"
        )
    report = FsxStageReport(folder, association, task, num_files, num_bytes, time.monotonic() - started)
    logger.info("linked %s at %s (%s), imported: %s", prefix, folder, association.association_id, task)
    return report


def export_folders(
    folders: Sequence[Path],
    *,
    file_system_id: str,
    root: Path,
    mount: Path,
    s3_prefix: str,
    release: bool = False,
    client: Any = None,
    region: str | None = None,
    report_path: str | None = None,
    poll_s: float = 10.0,
    timeout_s: float = 3600.0,
) -> FsxExportReport:
    """Export ``folders`` (each under ``root``, which is under ``mount``) to ``s3_prefix``, through
    the one association of ``root``; then release their file-system space when ``release``.

    ``folders[i]`` lands at ``<s3_prefix>/<folders[i] relative to root>/``. The association is
    created without auto import or export (only explicit tasks move data) and is reused by later
    calls. Raises ``TunepodError`` for a folder outside ``root``, ``root`` outside ``mount``, or a
    failed association or task.
    """
    fsx = client if client is not None else fsx_client(region)
    prefix = parse_s3_uri(s3_prefix).uri
    root_path = file_system_path(root, mount)
    paths = [file_system_path(folder, mount, inside=root) for folder in folders]
    association = ensure_association(
        fsx,
        file_system_id,
        root_path,
        prefix,
        auto_import_events=(),
        batch_import_metadata=False,
        poll_s=poll_s,
        timeout_s=timeout_s,
    )
    exports = [
        export_to_repository(
            fsx, file_system_id, chunk, report_path=report_path, poll_s=poll_s, timeout_s=timeout_s
        )
        for chunk in _chunks(paths)
    ]
    # FSx releases only files already exported, so the releases run after every export finished.
    releases = [
        release_from_file_system(
            fsx, file_system_id, chunk, report_path=report_path, poll_s=poll_s, timeout_s=timeout_s
        )
        for chunk in (_chunks(paths) if release else [])
    ]
    below_root = [path[len(root_path) :].strip("/") for path in paths]
    uris = [f"{prefix}{rel}/" if rel else prefix for rel in below_root]
    return FsxExportReport(association, exports, releases, dict(zip(folders, uris, strict=True)))


def file_system_path(folder: Path, mount: Path, *, inside: Path | None = None) -> str:
    """``folder`` as a path inside the file system mounted at ``mount`` (``/jobs/study/trial-0``).

    Raises ``TunepodError`` when ``folder`` is not under ``mount`` (or not under ``inside``)."""
    folder, mount = folder.expanduser().resolve(), mount.expanduser().resolve()
    for outer, what in ((mount, "the file system's mount"), (inside, "the associated folder")):
        if outer is not None and outer.resolve() != folder and outer.resolve() not in folder.parents:
            raise TunepodError(
                f"{folder} is not under {outer.resolve()} ({what}), so FSx cannot name it; fix: set "
                "mount to where the file system is mounted and keep the launcher's root on it"
            )
    relative = folder.relative_to(mount).as_posix()
    return "/" if relative == "." else f"/{relative}"


def _chunks(paths: list[str]) -> list[list[str]]:
    return [paths[start : start + MAX_TASK_PATHS] for start in range(0, len(paths), MAX_TASK_PATHS)]


def _walk_counts(folder: Path) -> tuple[int, int]:
    """(files, bytes) under ``folder``: a metadata walk, which on Lustre loads no file contents."""
    num_files = num_bytes = 0
    for parent, _, names in os.walk(folder):
        for name in names:
            info = os.stat(os.path.join(parent, name), follow_symlinks=False)
            num_files += 1
            num_bytes += info.st_size
    return num_files, num_bytes
