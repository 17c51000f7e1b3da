"""Staging: put a dataset into a folder on the shared filesystem, copying only what changed.

``stage`` takes the ``source`` of a stage step (``builtin://NAME`` or a local folder) and mirrors it
into ``target`` with ``stage_folder``, which keeps a manifest of what it copied there.
"""

from __future__ import annotations

from pathlib import Path

from tunepod.errors import TunepodError
from tunepod.staging.folder import ManifestEntry, StageReport, read_manifest, stage_folder

__all__ = ["ManifestEntry", "StageReport", "read_manifest", "source_folder", "stage", "stage_folder"]

SUPPORTED_SOURCES = "builtin://NAME, a local folder path, or file:///absolute/path"


def stage(source_uri: str, target: Path, cache_dir: Path) -> StageReport:
    """Mirror the dataset ``source_uri`` into ``target``; builtins are first written under ``cache_dir``."""
    return stage_folder(source_folder(source_uri, cache_dir), target)


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
            f"cannot stage {source_uri}: s3:// sources are not supported yet; use {SUPPORTED_SOURCES}"
        )
    raise TunepodError(f"cannot stage {source_uri}: unknown scheme {scheme}://; use {SUPPORTED_SOURCES}")
