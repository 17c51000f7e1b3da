"""Folder staging with a manifest, on real files: what is copied, hashed, kept and removed."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import pytest
from file_identity import file_identity

from tunepod.errors import TunepodError
from tunepod.staging import folder, read_manifest, stage, stage_folder
from tunepod.staging.folder import MANIFEST_NAME, PARTIAL_SUFFIX, PROGRESS_NAME

FILES = {
    "a.txt": b"alpha\n",
    "sub/b.bin": bytes(range(256)) * 64,
    "sub/deeper/c.txt": b"gamma\n",
}


def make_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def tree(root: Path) -> dict[str, bytes]:
    """Every data file under ``root`` (tunepod's bookkeeping files left out) and its bytes."""
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.name.startswith(".tunepod-manifest")
    }


@pytest.fixture
def source(tmp_path: Path) -> Path:
    make_tree(tmp_path / "source", FILES)
    return tmp_path / "source"


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files the stager hashes outside of a copy, recorded while the real function does the work."""
    calls: list[Path] = []
    real = folder.sha256_of

    def recording(path: Path) -> str:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(folder, "sha256_of", recording)
    return calls


def test_first_stage_copies_every_file_and_records_it(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    report = stage_folder(source, target)
    assert tree(target) == FILES
    assert (report.num_files, report.copied_files, report.removed_files) == (3, 3, 0)
    assert report.num_bytes == report.copied_bytes == sum(len(data) for data in FILES.values())
    manifest = read_manifest(target)
    assert sorted(manifest) == sorted(FILES)
    for rel, data in FILES.items():
        assert manifest[rel].sha256 == hashlib.sha256(data).hexdigest()
        assert (
            manifest[rel].mtime_ns == (source / rel).stat().st_mtime_ns == (target / rel).stat().st_mtime_ns
        )


def test_restage_of_an_unchanged_source_copies_and_hashes_nothing(
    source: Path, tmp_path: Path, hashed: list[Path]
) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    manifest = (target / MANIFEST_NAME).stat()
    report = stage_folder(source, target)
    assert (report.copied_files, report.copied_bytes, report.removed_files) == (0, 0, 0)
    assert report.num_files == 3
    assert hashed == []
    # Not rewritten: nothing changed.
    assert file_identity((target / MANIFEST_NAME).stat()) == file_identity(manifest)


def test_a_changed_file_is_copied_alone(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    untouched = {rel: (target / rel).stat().st_ino for rel in FILES if rel != "a.txt"}
    (source / "a.txt").write_bytes(b"alpha, second edition\n")
    report = stage_folder(source, target)
    assert (report.copied_files, report.copied_bytes) == (1, len(b"alpha, second edition\n"))
    assert (target / "a.txt").read_bytes() == b"alpha, second edition\n"
    assert {rel: (target / rel).stat().st_ino for rel in untouched} == untouched


def test_a_touched_file_with_the_same_bytes_is_hashed_once_not_copied(
    source: Path, tmp_path: Path, hashed: list[Path]
) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    later = (source / "a.txt").stat().st_mtime_ns + 5_000_000_000
    os.utime(source / "a.txt", ns=(later, later))
    assert stage_folder(source, target).copied_files == 0
    assert hashed == [source / "a.txt"]
    assert (target / "a.txt").stat().st_mtime_ns == later
    assert stage_folder(source, target).copied_files == 0
    assert hashed == [source / "a.txt"]  # the new mtime was recorded: no hash the third time


def test_a_copy_damaged_in_the_target_is_copied_again(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    (target / "sub" / "b.bin").write_bytes(b"scribbled over")
    assert stage_folder(source, target).copied_files == 1
    assert tree(target) == FILES


def test_deleted_files_leave_the_target_but_foreign_files_stay(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    make_tree(target, {"foreign.txt": b"mine", "sub/deeper/notes.txt": b"also mine"})
    (source / "sub" / "deeper" / "c.txt").unlink()
    (source / "a.txt").unlink()
    (target / "a.txt").write_bytes(b"edited in the target after staging")

    report = stage_folder(source, target)
    assert report.removed_files == 1
    assert not (target / "sub" / "deeper" / "c.txt").exists()
    assert (target / "foreign.txt").read_bytes() == b"mine"
    assert (target / "sub" / "deeper" / "notes.txt").read_bytes() == b"also mine"
    assert (target / "a.txt").read_bytes() == b"edited in the target after staging"
    assert sorted(read_manifest(target)) == ["sub/b.bin"]


def test_a_folder_emptied_by_removal_is_removed(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    (source / "sub" / "deeper" / "c.txt").unlink()
    stage_folder(source, target)
    assert not (target / "sub" / "deeper").exists()
    assert (target / "sub" / "b.bin").exists()


def test_a_lost_manifest_is_rebuilt_by_comparing_contents(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    (target / MANIFEST_NAME).unlink()
    (target / "a.txt").write_bytes(b"alpha?\n")  # same size, other bytes: must be copied again
    report = stage_folder(source, target)
    assert report.copied_files == 1
    assert tree(target) == FILES
    assert sorted(read_manifest(target)) == sorted(FILES)


def changed_in_place(path: Path, data: bytes) -> None:
    """Give ``path`` other bytes of the same length and put its mtime back, as tar or rsync -t may."""
    kept = path.stat()
    assert len(data) == kept.st_size
    path.write_bytes(data)
    os.utime(path, ns=(kept.st_atime_ns, kept.st_mtime_ns))


def test_verify_copies_a_source_changed_with_its_size_and_mtime_kept(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    changed_in_place(source / "a.txt", b"ALPHA\n")
    assert stage_folder(source, target).copied_files == 0  # size and mtime are trusted by default
    assert (target / "a.txt").read_bytes() == FILES["a.txt"]

    report = stage_folder(source, target, verify=True)
    assert report.copied_files == 1
    assert (target / "a.txt").read_bytes() == b"ALPHA\n"
    assert read_manifest(target)["a.txt"].sha256 == hashlib.sha256(b"ALPHA\n").hexdigest()


def test_verify_copies_again_a_staged_copy_changed_in_place(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    changed_in_place(target / "sub" / "deeper" / "c.txt", b"GAMMA\n")
    report = stage(str(source), target, tmp_path / "cache", verify=True)
    assert report.copied_files == 1
    assert tree(target) == FILES


def test_a_progress_log_torn_by_a_kill_keeps_its_whole_lines_and_takes_new_ones(
    source: Path, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    entries = read_manifest(target)
    (target / MANIFEST_NAME).unlink()
    whole = json.dumps({"path": "a.txt", "size": 6, "sha256": entries["a.txt"].sha256, "mtime_ns": 1})
    (target / PROGRESS_NAME).write_text(whole + "\n" + whole[:25])  # killed in the middle of a line
    assert sorted(read_manifest(target)) == ["a.txt"]

    log = folder.ProgressLog(target)
    log.record("sub/b.bin", entries["sub/b.bin"])
    log.close()
    assert read_manifest(target) == {
        "a.txt": replace(entries["a.txt"], mtime_ns=1),
        "sub/b.bin": entries["sub/b.bin"],
    }


def test_a_staged_folder_can_be_a_source_without_its_bookkeeping(source: Path, tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    stage_folder(source, first)
    report = stage_folder(first, second)
    assert report.num_files == 3
    assert tree(second) == FILES
    assert sorted(read_manifest(second)) == sorted(FILES)


def interrupt_copies_of(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the copy of ``name`` fail half-way through, after part of it reached the partial file."""
    real = folder._copy_stream

    def crashing(src: BinaryIO, dst: BinaryIO, digest: hashlib._Hash) -> None:
        if Path(src.name).name != name:
            real(src, dst, digest)
            return
        dst.write(src.read(100))
        dst.flush()
        raise OSError(errno.EIO, "Input/output error (simulated)")

    monkeypatch.setattr(folder, "_copy_stream", crashing)


def partial_files(root: Path) -> list[Path]:
    return sorted(root.rglob(f"*{PARTIAL_SUFFIX}"))


def test_an_interrupted_first_copy_leaves_no_partial_file_and_the_next_run_completes(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "target"
    interrupt_copies_of("b.bin", monkeypatch)
    with pytest.raises(TunepodError, match=r"failed on sub/b\.bin: .*Input/output error"):
        stage_folder(source, target, workers=1)
    assert not (target / "sub" / "b.bin").exists()
    assert partial_files(target) == []
    recorded = read_manifest(target)
    assert "sub/b.bin" not in recorded
    assert "a.txt" in recorded  # copied before the failure (one worker, in walk order): progress kept
    assert all((target / rel).read_bytes() == FILES[rel] for rel in recorded)  # the record is true

    monkeypatch.undo()
    report = stage_folder(source, target, workers=2)
    assert report.copied_files == len(FILES) - len(recorded)
    assert tree(target) == FILES


def test_an_interrupted_update_keeps_the_previous_copy_whole(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    new_bytes = bytes(reversed(FILES["sub/b.bin"]))
    (source / "sub" / "b.bin").write_bytes(new_bytes)
    interrupt_copies_of("b.bin", monkeypatch)
    with pytest.raises(TunepodError, match=r"sub/b\.bin"):
        stage_folder(source, target)
    assert (target / "sub" / "b.bin").read_bytes() == FILES["sub/b.bin"]
    assert partial_files(target) == []

    monkeypatch.undo()
    assert stage_folder(source, target).copied_files == 1
    assert (target / "sub" / "b.bin").read_bytes() == new_bytes


def test_manifest_is_json_mapping_paths_to_size_hash_and_source_mtime(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    stage_folder(source, target)
    raw = json.loads((target / MANIFEST_NAME).read_text())
    assert raw["files"]["a.txt"] == {
        "size": len(FILES["a.txt"]),
        "sha256": hashlib.sha256(FILES["a.txt"]).hexdigest(),
        "mtime_ns": (source / "a.txt").stat().st_mtime_ns,
    }


def test_a_missing_source_is_explained(tmp_path: Path) -> None:
    with pytest.raises(TunepodError, match="does not exist"):
        stage_folder(tmp_path / "nowhere", tmp_path / "target")


def test_a_file_as_source_is_explained(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("x\n")
    with pytest.raises(TunepodError, match="it is a file, not a folder"):
        stage_folder(tmp_path / "data.csv", tmp_path / "target")


@pytest.mark.parametrize("inside", ["staged", "."])
def test_a_target_inside_the_source_is_refused(source: Path, inside: str) -> None:
    with pytest.raises(TunepodError, match="target is inside the source"):
        stage_folder(source, source / inside)
    assert not (source / "staged").exists()


def test_stage_takes_a_local_folder_or_a_file_uri(source: Path, tmp_path: Path) -> None:
    assert stage(str(source), tmp_path / "one", cache_dir=tmp_path / "cache").copied_files == 3
    assert stage(f"file://{source}", tmp_path / "two", cache_dir=tmp_path / "cache").copied_files == 3
    assert tree(tmp_path / "two") == FILES


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("gs://bucket/data", "unknown scheme gs://"),
    ],
)
def test_stage_explains_unsupported_sources(tmp_path: Path, uri: str, message: str) -> None:
    with pytest.raises(TunepodError, match=message) as caught:
        stage(uri, tmp_path / "target", cache_dir=tmp_path / "cache")
    assert "builtin://NAME" in str(caught.value)


def test_stage_materializes_a_builtin_then_copies_only_once(tmp_path: Path) -> None:
    target, cache = tmp_path / "target", tmp_path / "cache"
    first = stage("builtin://digits", target, cache_dir=cache)
    assert first.num_files > 0
    assert first.copied_files == first.num_files
    assert stage("builtin://digits", target, cache_dir=cache).copied_files == 0
    assert tree(target) == tree(cache / "digits")
