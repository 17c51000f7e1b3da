"""Mirror a folder into another one, copying only what changed, with a manifest of what tunepod put there.

The manifest ``<target>/.tunepod-manifest.json`` maps each relative path to the ``size``, ``sha256``
and ``mtime_ns`` of the source file that was staged (files staged from S3 also record the object's
ETag, see ``tunepod.staging.s3``). It is what makes a restage cheap and safe:

- a source file whose (size, mtime_ns) match its entry is not hashed again;
- a staged copy counts as intact when its size and mtime match the entry (each copy gets the
  source's mtime), so an intact copy of an unchanged file is neither read nor copied;
- a file deleted from the source is removed from the target only if the manifest lists it and its
  copy is intact: files someone else put in the target, or edited there, are never deleted;
- with ``verify``, size and mtime are not trusted: the source and the copy are hashed and compared
  with the manifest's sha256, so a file changed in place with its size and mtime kept is copied again.

Every copy is written to ``.<name>.tunepod-partial`` next to its final name, fsynced, then renamed
over it, so an interrupted run never leaves half a file under a final name. Each completed copy is
also appended at once to ``.tunepod-manifest.progress`` (see ``ProgressLog``), which ``read_manifest``
folds in: a run that fails, or is SIGKILLed, part-way keeps its progress, and the next run copies only
the rest. The manifest itself is rewritten (atomically) once, at the end of a run, which then deletes
the progress log. A full filesystem raises ``DiskFullError`` naming the file and the free space. One
stager per target at a time: a lock file in the target serializes concurrent runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import io
import json
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from tunepod import watch
from tunepod.errors import TunepodError
from tunepod.runtime.files import (
    append_whole,
    disk_full_error,
    disk_full_explained,
    fsync_file,
    sha256_of,
    write_bytes_atomic,
)

logger = logging.getLogger(__name__)

MANIFEST_NAME = ".tunepod-manifest.json"
LOCK_NAME = ".tunepod-manifest.lock"
PROGRESS_NAME = ".tunepod-manifest.progress"
PARTIAL_SUFFIX = ".tunepod-partial"
_MANIFEST_VERSION = 1
_CHUNK_BYTES = 4 << 20
# A crash of the machine (not of the process) loses at most this much of the progress log.
_PROGRESS_FSYNC_S = 1.0
DISK_FULL_FIX = (
    "free space there, or point the stage step's target at a larger filesystem; what was staged is "
    "recorded, so running the stage again copies only the rest"
)


class StageReport(BaseModel):
    """What one ``stage_folder`` run found and did."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: Path = Field(description="The staged folder.")
    num_files: int = Field(description="Files in the source, all now mirrored in the target.")
    num_bytes: int = Field(description="Their total size.")
    copied_files: int = Field(description="Files this run copied (new or changed).")
    copied_bytes: int = Field(description="Bytes this run copied.")
    removed_files: int = Field(description="Staged files removed because they left the source.")
    seconds: float = Field(description="Wall-clock duration of the run.")


@dataclass(frozen=True)
class ManifestEntry:
    """A staged file: the source's size, content hash and modification time when it was staged.

    ``etag``, ``etag_kind`` (``etag`` or ``etag-multipart``) and ``checksum_sha256`` are set only for
    a file staged from S3: they identify the object version that was downloaded.
    """

    size: int
    sha256: str
    mtime_ns: int
    etag: str | None = None
    etag_kind: str | None = None
    checksum_sha256: str | None = None

    def describes(self, info: os.stat_result) -> bool:
        """Whether a file with ``info`` has this entry's size and mtime (cheap proxy for its content)."""
        return info.st_size == self.size and info.st_mtime_ns == self.mtime_ns


Manifest = dict[str, ManifestEntry]


@dataclass(frozen=True)
class _FileTask:
    rel: str
    source: Path
    target: Path
    info: os.stat_result
    previous: ManifestEntry | None


@dataclass(frozen=True)
class Synced:
    entry: ManifestEntry
    copied: bool


def stage_folder(source: Path, target: Path, *, workers: int = 4, verify: bool = False) -> StageReport:
    """Mirror the files of ``source`` into ``target`` (see the module docstring for the rules).

    Raises ``TunepodError`` for a missing source, a source that is not a folder, a target inside the
    source, and for a copy that failed (after recording the copies that completed); its subclass
    ``DiskFullError`` when the target's filesystem is full. Empty folders and non-regular files
    (sockets, fifos, symlinked folders) are not mirrored. ``verify`` compares checksums instead of
    trusting an unchanged size and mtime.
    """
    started = time.monotonic()
    source, target = _checked_folders(source, target)
    with disk_full_explained(target, DISK_FULL_FIX):
        target.mkdir(parents=True, exist_ok=True)
        with exclusive(target / LOCK_NAME):
            previous = read_manifest(target)
            files = dict(_source_files(source))
            # Unchanged files are settled here, without a task each: a restage is then a stat of
            # each file and its copy, and nothing else.
            unchanged = {} if verify else _unchanged(files, previous, target)
            tasks = [_task(source, target, rel, info, previous.get(rel)) for rel, info in files.items()
                     if rel not in unchanged]  # fmt: skip
            sync = _counted(functools.partial(_sync_file, verify=verify), tasks)
            synced = {**unchanged, **sync_all(tasks, previous, target, workers, sync)}
            removed = remove_deleted(target, previous, set(files))
            write_manifest(target, {rel: result.entry for rel, result in synced.items()}, previous)
    copied = [result.entry.size for result in synced.values() if result.copied]
    report = StageReport(
        target=target,
        num_files=len(files),
        num_bytes=sum(info.st_size for info in files.values()),
        copied_files=len(copied),
        copied_bytes=sum(copied),
        removed_files=removed,
        seconds=time.monotonic() - started,
    )
    logger.info("staged %s -> %s: %s", source, target, report)
    return report


def read_manifest(target: Path) -> Manifest:
    """What is staged in ``target``: its manifest, with the copies a run that did not finish recorded
    in the progress log folded over it. Empty when there is none or it is unreadable (nothing is then
    deleted, and copies are verified by content before being trusted again)."""
    return {**_manifest_file(target), **_progress_entries(target / PROGRESS_NAME)}


def _manifest_file(target: Path) -> Manifest:
    path = target / MANIFEST_NAME
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        return {rel: ManifestEntry(**entry) for rel, entry in files.items()}
    except FileNotFoundError:
        return {}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("ignoring unreadable staging manifest %s (%s); verifying every file", path, exc)
        return {}


def _progress_entries(path: Path) -> Manifest:
    """The entries of a progress log, later lines winning; a line torn by a kill is skipped."""
    try:
        lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return {}
    entries: Manifest = {}
    for line in lines:
        try:
            raw = json.loads(line)
            rel = raw.pop("path")
            entries[rel] = ManifestEntry(**raw)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # empty, or torn: that file is checked again by content, never trusted
    return entries


def write_manifest(target: Path, manifest: Manifest, previous: Manifest | None = None) -> None:
    """Replace the manifest of ``target`` atomically; then the progress log it now includes goes.
    Given the ``previous`` manifest this run read, an unchanged one with no progress log to fold in is
    left as it is: a restage that changed nothing writes (and fsyncs) nothing."""
    unchanged = manifest == previous and not (target / PROGRESS_NAME).exists()
    if unchanged and (target / MANIFEST_NAME).exists():
        return
    files = {rel: _entry_fields(manifest[rel]) for rel in sorted(manifest)}
    data = json.dumps({"version": _MANIFEST_VERSION, "files": files}, indent=1) + "\n"
    write_bytes_atomic(target / MANIFEST_NAME, data.encode("utf-8"))
    (target / PROGRESS_NAME).unlink(missing_ok=True)


class ProgressLog:
    """``.tunepod-manifest.progress``: one JSON line per file a run staged, appended as it completes.

    Why a log and not a manifest rewritten every N files: an append costs the same for the millionth
    file as for the first, where a rewrite costs the whole manifest each time, and a kill loses
    nothing recorded. Each line is written with one unbuffered append, so a SIGKILL loses at most
    the files still in flight; it is fsynced at most once a second and on close, so a crash of the
    machine loses at most the last second's lines. A lost line only costs a check: its file is then
    compared by content (or downloaded again) on the next run, never trusted blindly. Written from
    one thread only (``sync_all``'s), under the target's lock.
    """

    def __init__(self, target: Path) -> None:
        self.path = target / PROGRESS_NAME
        self._unsynced = False
        self._synced_at = time.monotonic()
        self._started = False

    def record(self, rel: str, entry: ManifestEntry) -> None:
        line = json.dumps({"path": rel, **_entry_fields(entry)}).encode("utf-8") + b"\n"
        if not self._started:
            self._started = True
            line = self._newline_if_torn() + line
        fsync = time.monotonic() - self._synced_at >= _PROGRESS_FSYNC_S
        with disk_full_explained(self.path, DISK_FULL_FIX):
            append_whole(self.path, line, fsync=fsync)
        self._unsynced = not fsync
        if fsync:
            self._synced_at = time.monotonic()

    def close(self) -> None:
        if self._unsynced:
            fsync_file(self.path)
            self._unsynced = False

    def _newline_if_torn(self) -> bytes:
        """A killed run may have left half a line: end it, so the next line is not glued onto it."""
        try:
            with open(self.path, "rb") as log:
                if log.seek(0, os.SEEK_END) == 0:
                    return b""
                log.seek(-1, os.SEEK_END)
                return b"" if log.read(1) == b"\n" else b"\n"
        except FileNotFoundError:
            return b""


def _entry_fields(entry: ManifestEntry) -> dict[str, object]:
    # A folder's entries stay {size, sha256, mtime_ns}: the S3-only fields appear only when set.
    # Not dataclasses.asdict: it deep-copies every field, a cost paid for each of a million files.
    return {name: value for name, value in vars(entry).items() if value is not None}


def _checked_folders(source: Path, target: Path) -> tuple[Path, Path]:
    source, target = source.expanduser().resolve(), target.expanduser().resolve()
    if not source.exists():
        raise TunepodError(
            f"cannot stage {source}: it does not exist; fix: point the source at an existing folder"
        )
    if not source.is_dir():
        raise TunepodError(
            f"cannot stage {source}: it is a file, not a folder; fix: point the source at its folder"
        )
    if target == source or source in target.parents:
        raise TunepodError(
            f"cannot stage {source} into {target}: the target is inside the source, so staging would copy "
            "into the folder it reads; fix: choose a target outside the source"
        )
    if target.exists() and not target.is_dir():
        raise TunepodError(f"cannot stage into {target}: it is a file; fix: choose a folder as the target")
    return source, target


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as exc:  # some network filesystems have no flock; staging still works alone
            logger.warning("cannot lock %s (%s); do not stage into this folder twice at once", lock_path, exc)
        yield


def is_reserved(rel: str) -> bool:
    # A staged folder used as a source holds our own bookkeeping files: never mirror those.
    return rel in (MANIFEST_NAME, LOCK_NAME, PROGRESS_NAME) or rel.endswith(PARTIAL_SUFFIX)


def _source_files(source: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative posix path, stat) of every regular file under ``source``, symlinks to files followed.
    Plain strings, not ``Path``s: a restage of a million unchanged files spends most of its time here."""
    root = str(source)
    for folder, subfolders, names in os.walk(root):
        for name in subfolders:
            if os.path.islink(os.path.join(folder, name)):
                logger.warning("staging skips %s: a symlink to a folder", os.path.join(folder, name))
        below = os.path.relpath(folder, root).replace(os.sep, "/")
        for name in sorted(names):
            rel = name if below == "." else f"{below}/{name}"
            info = stat_or_none(os.path.join(folder, name))
            if info is None or not stat.S_ISREG(info.st_mode):
                logger.warning(
                    "staging skips %s: not a regular file (or a broken symlink)", Path(folder, name)
                )
            elif not is_reserved(rel):
                yield rel, info


def stat_or_none(path: str | Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _unchanged(files: dict[str, os.stat_result], previous: Manifest, target: Path) -> dict[str, Synced]:
    """The files whose source and staged copy both still match their manifest entry (size, mtime)."""
    unchanged = {}
    root = str(target)
    for rel, info in files.items():
        entry = previous.get(rel)
        if entry is not None and entry.describes(info):
            copy = stat_or_none(f"{root}/{rel}")
            if copy is not None and entry.describes(copy):
                unchanged[rel] = Synced(entry, copied=False)
    return unchanged


def _counted(sync: Callable[[_FileTask], Synced], tasks: list[_FileTask]) -> Callable[[_FileTask], Synced]:
    """``sync``, counting the bytes of each file it settled for whoever watches the run (``watch``)."""
    count = watch.progress(sum(task.info.st_size for task in tasks), "bytes")

    def counted(task: _FileTask) -> Synced:
        synced = sync(task)
        count(task.info.st_size)
        return synced

    return counted


def _task(
    source: Path, target: Path, rel: str, info: os.stat_result, previous: ManifestEntry | None
) -> _FileTask:
    return _FileTask(rel=rel, source=source / rel, target=target / rel, info=info, previous=previous)


class Readable(Protocol):
    """What ``write_stream_atomic`` reads from: an open file, or an S3 response body."""

    def read(self, size: int = ..., /) -> bytes: ...


class _NamedTask(Protocol):
    @property
    def rel(self) -> str: ...


_Task = TypeVar("_Task", bound=_NamedTask)


def sync_all(
    tasks: Sequence[_Task],
    previous: Manifest,
    target: Path,
    workers: int,
    sync: Callable[[_Task], Synced],
) -> dict[str, Synced]:
    """Run ``sync`` on every task, ``workers`` at a time, recording each new entry in the progress log
    as it completes. On the first failure, stop starting new ones, record what completed and raise
    ``TunepodError`` naming the file that failed (``DiskFullError`` when its filesystem is full).
    Shared by the folder and the S3 stagers; ``sync`` is called from worker threads."""
    progress = ProgressLog(target)
    recorded: set[str] = set()

    def record(task: _Task, result: Synced) -> None:
        if result.entry != previous.get(task.rel):  # an unchanged file is recorded already
            progress.record(task.rel, result.entry)
        recorded.add(task.rel)

    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tunepod-stage") as pool:
            futures = {pool.submit(sync, task): task for task in tasks}
            try:
                for future in as_completed(futures):
                    if future.exception() is not None:
                        break
                    record(futures[future], future.result())
            finally:
                for pending in futures:
                    pending.cancel()
        # Leaving the pool waited for the copies in flight: every future is now cancelled or done.
        for future, task in futures.items():
            if _succeeded(future) and task.rel not in recorded:
                record(task, future.result())
    finally:
        progress.close()
    synced = {task.rel: future.result() for future, task in futures.items() if _succeeded(future)}
    failed = next(((future, task) for future, task in futures.items() if _failed(future)), None)
    if failed is not None:
        future, task = failed
        exc = future.exception()
        if not isinstance(exc, Exception):
            future.result()  # re-raises a KeyboardInterrupt or the like as it was: not ours to rephrase
        full = None if exc is None else disk_full_error(exc, target / task.rel, DISK_FULL_FIX)
        if full is not None:
            raise full from exc
        raise TunepodError(
            f"staging into {target} failed on {task.rel}: {exc}; {len(synced)} of {len(tasks)} files are "
            "staged and recorded, run the stage again to finish"
        ) from exc
    return synced


def _succeeded(future: Future[Synced]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _failed(future: Future[Synced]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is not None


def _sync_file(task: _FileTask, *, verify: bool) -> Synced:
    """Make ``task.target`` hold ``task.source``'s bytes, copying only when the content differs;
    ``verify`` hashes both sides instead of trusting an unchanged size and mtime."""
    info, previous = task.info, task.previous
    target_info = stat_or_none(task.target)
    if previous is not None and target_info is not None and previous.describes(target_info):
        if previous.describes(info) and not verify:
            return Synced(previous, copied=False)  # unchanged since staged: no read at all
        sha256 = sha256_of(task.source)
        copy_intact = not verify or sha256_of(task.target) == previous.sha256
        if sha256 == previous.sha256 and copy_intact:  # touched (or verified), same bytes
            return Synced(_adopt(task, sha256), copied=False)
    elif previous is None and target_info is not None and target_info.st_size == info.st_size:
        # No record (a first stage, or a run killed before writing its manifest): trust the copy
        # only after comparing contents.
        sha256 = sha256_of(task.source)
        if sha256_of(task.target) == sha256:
            return Synced(_adopt(task, sha256), copied=False)
    return Synced(ManifestEntry(info.st_size, _copy_atomic(task), info.st_mtime_ns), copied=True)


def _adopt(task: _FileTask, sha256: str) -> ManifestEntry:
    """Record an existing copy with the right content: give it the source's mtime, as a copy gets."""
    os.utime(task.target, ns=(task.info.st_atime_ns, task.info.st_mtime_ns))
    return ManifestEntry(task.info.st_size, sha256, task.info.st_mtime_ns)


def _copy_atomic(task: _FileTask) -> str:
    """Copy through a partial file that is fsynced, then renamed over the target; returns the sha256
    of the bytes copied. The partial file is removed if anything fails."""
    with open(task.source, "rb") as src:
        return write_stream_atomic(
            src,
            task.target,
            mode=stat.S_IMODE(task.info.st_mode),
            times_ns=(task.info.st_atime_ns, task.info.st_mtime_ns),
        )


def write_stream_atomic(src: Readable, target: Path, *, mode: int, times_ns: tuple[int, int]) -> str:
    """Write what ``src`` reads to ``target`` through ``.<name>.tunepod-partial`` (see ``atomic_partial``);
    returns the sha256 of the bytes written."""
    digest = hashlib.sha256()
    with atomic_partial(target, mode=mode, times_ns=times_ns) as dst:
        _copy_stream(src, dst, digest)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_partial(target: Path, *, mode: int, times_ns: tuple[int, int]) -> Iterator[io.BufferedRandom]:
    """``.<name>.tunepod-partial`` beside ``target``, open to write (and to read back); when the block
    ends it is fsynced, given ``mode`` and (atime, mtime) ``times_ns``, then renamed over ``target``.
    If anything fails it is removed, so ``target`` is whole or untouched."""
    partial = target.with_name(f".{target.name}{PARTIAL_SUFFIX}")
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(partial, "w+b") as dst:
            yield dst
            dst.flush()
            os.fsync(dst.fileno())
        os.chmod(partial, mode)
        os.utime(partial, ns=times_ns)
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _copy_stream(src: Readable, dst: BinaryIO, digest: hashlib._Hash) -> None:
    """Copy ``src`` to ``dst`` in chunks, hashing what is read (one read serves both)."""
    while chunk := src.read(_CHUNK_BYTES):
        digest.update(chunk)
        dst.write(chunk)


def remove_deleted(target: Path, previous: Manifest, current: set[str]) -> int:
    """Remove intact staged copies of files that left the source; returns how many were removed."""
    removed = 0
    for rel in sorted(set(previous) - current):
        path = target / rel
        info = stat_or_none(path)
        if info is None:
            continue
        if not previous[rel].describes(info):
            logger.warning("staging leaves %s: it left the source but was changed in the target", path)
            continue
        path.unlink()
        removed += 1
        _remove_empty_parents(path.parent, target)
    return removed


def _remove_empty_parents(folder: Path, stop: Path) -> None:
    while folder != stop:
        try:
            folder.rmdir()
        except OSError:  # not empty (or already gone): stop climbing
            return
        folder = folder.parent
