"""A new SQLite tracking store starts as a copy of an empty one, instead of being built by MLflow's
migrations each time.

Opening a SQLite store that does not exist makes MLflow create its tables by running every one of its
schema migrations: seconds of CPU (5 s on two loaded cores, 1.2 s quiet), paid by the first run of every
new store (each test, each benchmark run, each user's new ``tracking.uri``). The first time it is
needed, MLflow builds one empty store for its installed version in tunepod's cache folder; every new
store after that is a copy of it, which MLflow opens as it opens any store whose schema is current.

The cached store has no experiment at all: MLflow creates its ``Default`` experiment (id 0) on opening a
store without one, so the copy gets it exactly as a fresh store would, with the artifact location of the
process that opens it. Anything that goes wrong here leaves the store to MLflow, as before: the cache is
a shortcut, never a second way to build a store.

A store on a local filesystem is kept in SQLite's write-ahead log mode (``use_write_ahead_log``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
from pathlib import Path

from tunepod.locks import locked
from tunepod.runtime.files import mount_point

logger = logging.getLogger(__name__)

SQLITE_PREFIX = "sqlite:///"
CACHE_ENV = "TUNEPOD_CACHE_DIR"
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "overlay"})
"""Filesystems that only their own host can open a file on (no NFS, Lustre, FSx, FUSE...)."""


def cache_dir() -> Path:
    """``TUNEPOD_CACHE_DIR``, else ``$XDG_CACHE_HOME/tunepod``, else ``~/.cache/tunepod``."""
    if chosen := os.environ.get(CACHE_ENV):
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tunepod"


def seed_new_store(tracking_uri: str) -> bool:
    """For a ``sqlite:///`` URI whose file does not exist yet, put a copy of the cached empty store there
    (building the cache first if needed); True when it did. Call it under the store's schema lock."""
    if not tracking_uri.startswith(SQLITE_PREFIX):
        return False
    database = Path(tracking_uri[len(SQLITE_PREFIX) :])
    if database.exists() or not database.parent.is_dir():
        return False
    seeding = database.with_name(f".{database.name}.{os.getpid()}.seeding")
    try:
        shutil.copyfile(empty_store(), seeding)
        # A link, not a rename: it fails if a store appeared meanwhile (MLflow itself, another tool),
        # where a rename would replace it.
        os.link(seeding, database)
    except Exception as exc:  # any failure: MLflow builds (or opens) the store itself, as before
        logger.debug("new MLflow store %s not seeded from the cache: %s", database, exc)
        return False
    finally:
        seeding.unlink(missing_ok=True)
    return True


def empty_store() -> Path:
    """The cached empty store of the installed MLflow version, built by MLflow on first use."""
    import mlflow

    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    cached = folder / f"mlflow-{mlflow.__version__}-empty.db"
    with locked(cached.with_name(cached.name + ".lock")):
        if not cached.exists():
            building = cached.with_name(f".{cached.name}.{os.getpid()}.building")
            building.unlink(missing_ok=True)
            try:
                _build_empty_store(building)
                os.replace(building, cached)
            finally:
                building.unlink(missing_ok=True)
    return cached


def _build_empty_store(path: Path) -> None:
    """MLflow's own migrations build the store; then its Default experiment is removed (see above)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore(f"{SQLITE_PREFIX}{path}", str(path.parent / "unused-artifacts"))  # type: ignore[no-untyped-call]
    store.engine.dispose()
    with sqlite3.connect(path) as connection:
        connection.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
        connection.execute("DELETE FROM experiments WHERE experiment_id = 0")
    connection.close()


def use_write_ahead_log(tracking_uri: str) -> bool:
    """Put the ``sqlite:///`` store in SQLite's write-ahead log mode if its file is on a local
    filesystem; True when the store is in that mode.

    Every MLflow call is a transaction, and the tracking outbox writes a trial's records one call
    after another on one thread (SQLite takes one writer at a time). In SQLite's default mode a commit
    syncs a rollback journal and then the database; with the write-ahead log it syncs the log alone
    (synchronous stays FULL: a commit is as durable as before), two to three times faster per MLflow
    call here, so the writes keep up with short trials instead of piling up until the study's end.

    The mode is the file's, for every process that opens it, and the write-ahead log shares an index
    in memory: every one of them must run on one host. So only a file on a local filesystem, which no
    other host can open, is switched; a store on NFS, Lustre or FSx keeps its journal."""
    if not tracking_uri.startswith(SQLITE_PREFIX):
        return False
    database = Path(tracking_uri[len(SQLITE_PREFIX) :])
    if not database.is_file() or filesystem_type(database) not in LOCAL_FILESYSTEMS:
        return False
    try:
        with contextlib.closing(sqlite3.connect(database, timeout=30)) as connection:
            mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    except sqlite3.Error as exc:  # a busy or read-only store: it stays as it is
        logger.debug("MLflow store %s left in its journal mode: %s", database, exc)
        return False
    return str(mode).lower() == "wal"


def filesystem_type(path: Path, mounts: Path = Path("/proc/mounts")) -> str | None:
    """The type of the filesystem ``path`` is on (``ext4``, ``nfs4``...), from ``mounts`` (Linux's
    list of mounts); None where that cannot be read (not Linux)."""
    try:
        lines = mounts.read_text().splitlines()
    except OSError:
        return None
    where = str(mount_point(path))
    found = None
    for line in lines:
        fields = line.split()
        # Octal escapes in mount points (a space is \040); the last entry for a point is the one in use.
        if len(fields) >= 3 and fields[1].encode().decode("unicode_escape") == where:
            found = fields[2]
    return found
