"""Staging: put a dataset into a folder on the shared filesystem, copying only what changed.

``stage`` takes the ``source`` of a stage step (``builtin://NAME``, a local folder or
``s3://bucket/prefix/``) and mirrors it into ``target`` with ``stage_folder`` or ``stage_s3``, which
keep a manifest of what they copied there. An ``fsx://<file-system-id>/<path>`` target is not a
copy: ``stage_fsx`` links the S3 prefix into FSx for Lustre, and ``export_folders`` sends folders
back to S3 (``fsx_stage``, over the data repository calls of ``fsx``).
"""

from __future__ import annotations

from pathlib import Path

from tunepod.errors import TunepodError
from tunepod.staging.folder import ManifestEntry, StageReport, read_manifest, stage_folder
from tunepod.staging.fsx_stage import FsxTarget, export_folders, stage_fsx
from tunepod.staging.s3 import stage_s3

__all__ = [
    "FsxTarget",
    "ManifestEntry",
    "StageReport",
    "export_folders",
    "read_manifest",
    "source_folder",
    "stage",
    "stage_folder",
    "stage_fsx",
    "stage_s3",
]

SUPPORTED_SOURCES = "builtin://NAME, a local folder path, file:///absolute/path, or s3://bucket/prefix/"


def stage(source_uri: str, target: Path, cache_dir: Path, *, verify: bool = False) -> StageReport:
    """Mirror the dataset ``source_uri`` into ``target``; builtins are first written under ``cache_dir``.
    ``verify`` compares checksums instead of trusting an unchanged size and mtime."""
    if source_uri.startswith("s3://"):
        return stage_s3(source_uri, target, verify=verify)
    return stage_folder(source_folder(source_uri, cache_dir), target, verify=verify)


def source_folder(source_uri: str, cache_dir: Path) -> Path:
    """The local folder holding ``source_uri``; raises ``TunepodError`` for a scheme not supported."""
    scheme, separator, rest = source_uri.partition("://")
    if not separator:
        return Path(source_uri).expanduser()
    if scheme == "builtin":
        # Imported here: building a builtin dataset needs numpy and scikit-learn.
        from tunepod.staging.builtin import materialize_builtin

        return materialize_builtin(source_uri, cache_dir)
    if scheme == "file":
        return Path(rest)
    if scheme == "s3":
        raise TunepodError(
            f"{source_uri} is not a local folder: s3:// sources are downloaded by stage(), not read in place"
        )
    raise TunepodError(f"cannot stage {source_uri}: unknown scheme {scheme}://; use {SUPPORTED_SOURCES}")
