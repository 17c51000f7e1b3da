"""Staging under real faults: a stager SIGKILLed part-way (from a folder, and from a moto S3 server)
and a target filesystem that fills up (a size-limited tmpfs the test mounts). The next run must copy
only what was not finished, and what is recorded must always be true."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from moto_server import REGION, MotoServer, put_objects
from tmpfs import MiB, mounted_tmpfs

from tunepod.errors import DiskFullError
from tunepod.staging import read_manifest, stage_folder, stage_s3
from tunepod.staging.folder import PARTIAL_SUFFIX, PROGRESS_NAME

pytest.importorskip("boto3")

REPO = Path(__file__).resolve().parents[2]
BUCKET = "datasets"
KILL_AFTER = 10  # a stager is killed once this many files are in place, far from all of them
MANY = {f"part-{index:04d}.bin": index.to_bytes(2, "big") * 4096 for index in range(300)}
MANY_OBJECTS = dict(list(MANY.items())[:80])  # fewer: each request to moto costs tens of ms here
BIG = {f"shard-{index}.bin": bytes([index]) * MiB for index in range(6)}


def write_tree(root: Path, files: Mapping[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    return root


def in_place(target: Path) -> set[str]:
    """The files under their final names in ``target`` (no bookkeeping, no partial copies)."""
    try:
        return {entry.name for entry in os.scandir(target) if not entry.name.startswith(".")}
    except FileNotFoundError:
        return set()


def recorded_lines(target: Path) -> int:
    """Whole lines in the progress log: what a kill cannot take back."""
    try:
        return (target / PROGRESS_NAME).read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def tree(target: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in target.iterdir() if not path.name.startswith(".")}


def hidden_leftovers(target: Path) -> list[str]:
    return sorted(
        path.name for path in target.iterdir() if path.name.endswith((PARTIAL_SUFFIX, PROGRESS_NAME))
    )


@pytest.fixture
def s3(moto: MotoServer) -> Any:
    moto.reset()
    return moto.client("s3")


# ---------------------------------------------------------------------------------------------- kill

STAGER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from tunepod.staging import stage_folder, stage_s3
    source, target = sys.argv[2], Path(sys.argv[3])
    if source.startswith("s3://"):
        stage_s3(source, target, workers=2)
    else:
        stage_folder(Path(source), target, workers=2)
    """
)


def stage_until_killed(
    source: str, target: Path, num_files: int, env: Mapping[str, str] | None = None
) -> set[str]:
    """Run a stager of ``num_files`` files in its own process group, SIGKILL it once some are in place;
    the files in place then."""
    command = [sys.executable, "-c", STAGER, str(REPO), source, str(target)]
    stager = subprocess.Popen(command, start_new_session=True, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 120
        # Also wait for a first recorded line: on a busy host the recording thread can trail the
        # copying threads by many files, and a kill before it wrote anything would test nothing.
        while len(in_place(target)) < KILL_AFTER or not recorded_lines(target):
            assert stager.poll() is None, f"the stager ended (exit {stager.returncode}) before being killed"
            assert time.monotonic() < deadline, "the stager copied or recorded nothing"
            time.sleep(0.005)
        os.killpg(stager.pid, signal.SIGKILL)
    finally:
        if stager.poll() is None:
            os.killpg(stager.pid, signal.SIGKILL)
        stager.wait()
    assert stager.returncode == -signal.SIGKILL
    done = in_place(target)
    assert KILL_AFTER <= len(done) < num_files, "the kill must land part-way"
    return done


def assert_recorded_copies_are_true(target: Path, source: Mapping[str, bytes]) -> dict[str, Any]:
    recorded = read_manifest(target)
    assert recorded, "the killed run's finished copies must be recorded as they finish"
    assert all((target / rel).read_bytes() == source[rel] for rel in recorded)
    return recorded


def test_a_folder_stage_killed_part_way_is_finished_by_the_next_run(tmp_path: Path) -> None:
    source = write_tree(tmp_path / "source", MANY)
    target = tmp_path / "target"
    done = stage_until_killed(str(source), target, len(MANY))
    recorded = assert_recorded_copies_are_true(target, MANY)
    assert set(recorded) <= done

    report = stage_folder(source, target)
    # Recorded copies are skipped unread; copies in place but not yet recorded are compared, not copied.
    assert report.copied_files == len(MANY) - len(done)
    assert tree(target) == MANY
    assert sorted(read_manifest(target)) == sorted(MANY)
    assert hidden_leftovers(target) == []


def test_an_s3_stage_killed_part_way_is_finished_by_the_next_run(
    moto: MotoServer, s3: Any, tmp_path: Path
) -> None:
    put_objects(s3, BUCKET, "many/", MANY_OBJECTS)
    target = tmp_path / "target"
    env = {
        "AWS_ENDPOINT_URL_S3": moto.endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": str(tmp_path / "no-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
    }
    done = stage_until_killed(f"s3://{BUCKET}/many/", target, len(MANY_OBJECTS), env)
    recorded = assert_recorded_copies_are_true(target, MANY_OBJECTS)
    assert set(recorded) <= done

    report = stage_s3(f"s3://{BUCKET}/many/", target, client=s3)
    assert report.copied_files == len(MANY_OBJECTS) - len(recorded)  # unrecorded: downloaded again
    assert tree(target) == MANY_OBJECTS
    assert sorted(read_manifest(target)) == sorted(MANY_OBJECTS)
    assert hidden_leftovers(target) == []


# ---------------------------------------------------------------------------------------------- full disk


@pytest.fixture
def nearly_full_fs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """An 8 MiB tmpfs with about 3.5 MiB free (room for 3 of the 6 ``BIG`` files), and the ballast
    file whose removal frees the rest."""
    with mounted_tmpfs(tmp_path / "fs", 8 * MiB) as fs:
        ballast = fs / "ballast"
        ballast.write_bytes(b"\0" * (9 * MiB // 2))
        yield fs, ballast


def disk_full_message(target: Path, mount: Path) -> str:
    return f"no space left writing {target}/" + r"\S+: \d+\.\d MiB free on " + f"{mount}; fix: free space"


def test_a_folder_stage_into_a_full_filesystem_is_explained_and_a_rerun_finishes(
    tmp_path: Path, nearly_full_fs: tuple[Path, Path]
) -> None:
    fs, ballast = nearly_full_fs
    source = write_tree(tmp_path / "source", BIG)
    target = fs / "data"
    with pytest.raises(DiskFullError, match=disk_full_message(target, fs) + ".*copies only the rest"):
        stage_folder(source, target)
    assert not [name for name in hidden_leftovers(target) if name.endswith(PARTIAL_SUFFIX)]
    done = in_place(target)
    recorded = read_manifest(target)
    assert 0 < len(done) < len(BIG) and set(recorded) <= done
    assert all((target / rel).read_bytes() == BIG[rel] for rel in done)

    ballast.unlink()
    report = stage_folder(source, target)
    assert report.copied_files == len(BIG) - len(done)
    assert tree(target) == BIG and sorted(read_manifest(target)) == sorted(BIG)


def test_an_s3_stage_into_a_full_filesystem_is_explained_and_a_rerun_finishes(
    s3: Any, nearly_full_fs: tuple[Path, Path]
) -> None:
    fs, ballast = nearly_full_fs
    put_objects(s3, BUCKET, "big/", BIG)
    target = fs / "data"
    # Two downloads at a time: with the default 16 all six partial files grow at once, and on a loaded
    # machine they can fill the 3.5 MiB together before any one of them is whole.
    with pytest.raises(DiskFullError, match=disk_full_message(target, fs)):
        stage_s3(f"s3://{BUCKET}/big/", target, client=s3, workers=2)
    assert not [name for name in hidden_leftovers(target) if name.endswith(PARTIAL_SUFFIX)]
    recorded = read_manifest(target)
    assert 0 < len(recorded) < len(BIG)
    assert all((target / rel).read_bytes() == BIG[rel] for rel in recorded)

    ballast.unlink()
    report = stage_s3(f"s3://{BUCKET}/big/", target, client=s3)
    assert report.copied_files == len(BIG) - len(recorded)
    assert tree(target) == BIG and sorted(read_manifest(target)) == sorted(BIG)
