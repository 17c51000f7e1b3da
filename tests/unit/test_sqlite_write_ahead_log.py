"""A SQLite MLflow store on a local filesystem is put in the write-ahead log mode (one sync per
commit instead of two or three); one on a filesystem other hosts may share keeps its journal."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from tunepod.runtime.files import mount_point
from tunepod.tracking.sqlite_store import LOCAL_FILESYSTEMS, filesystem_type, use_write_ahead_log


def journal_mode(database: Path) -> str:
    with closing(sqlite3.connect(database)) as connection:
        return str(connection.execute("PRAGMA journal_mode").fetchone()[0]).lower()


def new_store(folder: Path) -> Path:
    database = folder / "mlflow.db"
    with closing(sqlite3.connect(database)) as connection:
        connection.execute("CREATE TABLE runs (id TEXT)")
    return database


def test_a_store_on_a_local_disk_is_switched_to_the_write_ahead_log(tmp_path: Path) -> None:
    if filesystem_type(tmp_path) not in LOCAL_FILESYSTEMS:
        pytest.skip(f"the temp folder is on {filesystem_type(tmp_path)}, not a local filesystem")
    database = new_store(tmp_path)
    assert use_write_ahead_log(f"sqlite:///{database}")
    assert journal_mode(database) == "wal"
    assert use_write_ahead_log(f"sqlite:///{database}"), "a store in that mode already stays in it"


def test_a_tracking_server_or_a_missing_file_is_left_alone(tmp_path: Path) -> None:
    assert not use_write_ahead_log("http://127.0.0.1:5000")
    assert not use_write_ahead_log(f"sqlite:///{tmp_path}/absent.db")
    assert not (tmp_path / "absent.db").exists()


def test_the_filesystem_is_read_from_the_mount_of_the_path(tmp_path: Path) -> None:
    point = str(mount_point(tmp_path)).replace(" ", "\\040")
    mounts = tmp_path / "mounts"
    mounts.write_text(
        f"server:/export {point} ext4 rw 0 0\n"
        f"server:/export {point} nfs4 rw,relatime 0 0\n"  # mounted over the first: this one is in use
        "proc /proc proc rw 0 0\n"
    )
    assert filesystem_type(tmp_path / "mlflow.db", mounts) == "nfs4"
    assert "nfs4" not in LOCAL_FILESYSTEMS
    assert filesystem_type(tmp_path, tmp_path / "no-such-file") is None
