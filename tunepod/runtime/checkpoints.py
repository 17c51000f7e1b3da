"""Checkpoints in ``step-N`` folders that are either whole or ignored (after torchtitan).

Layout under the job's checkpoint folder::

    step-000007/
        state.pt        the state: torch.save when torch is importable and the state is not bytes,
                        else pickle (``format`` in the metadata says which)
        metadata.json   {"step", "sha256", "size", "format", "time", "save_seconds"}, written last

A sharded step (format ``dcp``, written by every rank with torch.distributed.checkpoint, see
``tunepod.runtime.sharded``) holds DCP's files instead of ``state.pt`` (``.metadata`` and one
``__<rank>_<n>.distcp`` per rank and writer); its metadata.json lists each with its own sha256 and size
under ``files``, and ``sha256``/``size`` are those of that listing and the files' total.

``save_seconds`` is how long writing, fsyncing and hashing the state took (for an async sharded save,
from the call until every shard was written and hashed in the background; the rename that follows is
not counted); the orchestrator reads it for its checkpoint metric, since a training job never imports
prometheus-client. Checkpoints written before it existed have none.

A step counts only when its ``metadata.json`` exists and the state file matches its size and sha256.
The sha256 is computed once, as the state is written (a sharded step's files: once every rank wrote
its own), and checked by whatever loads a step (a resume, an evaluation, the logged model that
registration takes); the orchestrator's bookkeeping (a finished job's list of steps, the pruning of
old ones) trusts the metadata and the files' sizes, which cost no reading.
A save writes everything into a hidden temporary folder next to the final one, fsyncs the files and
the folder, then renames it into place, so a job killed mid-save leaves a hidden folder that every
reader ignores and the next save deletes before it writes (so the leftover never costs that save its
space). A save that finds the filesystem full removes what it wrote and raises ``DiskFullError``.

Ownership: only rank 0 saves (one writer per checkpoint folder; a sharded save's ranks write only
into the hidden folder rank 0 made, and rank 0 commits it); any rank, and the orchestrator, may read
at any time.

Nothing a writer of the shared folder puts there runs code on load: torch states load with
``weights_only=True``, pickle states (bytes, or any state saved without torch) with an unpickler that
refuses every global, and a state that such a loader would refuse is refused at save time instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import pickletools
import re
import secrets
import shutil
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tunepod.errors import TunepodError
from tunepod.runtime.contract import KEEP_CHECKPOINTS_ENV
from tunepod.runtime.files import disk_full_explained, fsync_dir, fsync_file, sha256_of
from tunepod.runtime.metrics import checked_step

STATE_FILE = "state.pt"
METADATA_FILE = "metadata.json"
TORCH_FORMAT = "torch"
PICKLE_FORMAT = "pickle"
DCP_FORMAT = "dcp"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")
# Hidden prefixes of folders that are never a checkpoint: a save in progress and a step being removed.
_TEMP_PREFIX = ".tmp-step-"
_TRASH_PREFIX = ".trash-step-"


class CheckpointStateError(TunepodError, ValueError):
    """A state the loader would refuse, refused at save time instead (the message says how to fix it)."""


class UnsafeCheckpointError(TunepodError, ValueError):
    """A checkpoint whose loading would run code (a crafted or foreign pickle): it is not loaded."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``metadata.json`` says about a valid step folder; reading it does not load the state."""

    step: int
    path: Path
    sha256: str
    size: int
    format: str
    time: float
    save_seconds: float | None = None
    """Seconds the save took (None for checkpoints written before this was recorded)."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: the step it completed, the state saved with it, and its folder."""

    step: int
    state: Any
    path: Path


def step_folder_name(step: int) -> str:
    """``step-000007`` for step 7: zero-padded so names sort like steps in a file browser."""
    return f"step-{step:06d}"


def save_checkpoint(checkpoint_dir: Path, state: Any, step: int, keep: int) -> Path:
    """Save ``state`` as step ``step`` atomically, keep the newest ``keep`` valid steps, return the folder.

    Saving a step that already exists (a resumed job redoing it) replaces it. Rank 0 only. A full
    filesystem raises ``DiskFullError`` and leaves the earlier steps as they were.
    """
    step = checked_step(step)
    return _commit_step(checkpoint_dir, step, keep, lambda temp: _write_step_folder(temp, state, step))


def _commit_step(checkpoint_dir: Path, step: int, keep: int, fill: Callable[[Path], None]) -> Path:
    """Rank 0: ``fill`` a hidden folder, rename it to ``step-N`` atomically, keep the newest ``keep``
    valid steps; return the folder. On failure the earlier steps stay as they were."""
    final = checkpoint_dir / step_folder_name(step)
    with disk_full_explained(final, disk_full_fix(keep)):
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        # A save killed mid-write left its hidden folder, as large as a state: on a nearly full
        # filesystem it would make this save fail, so it goes before anything is written.
        _remove_hidden_folders(checkpoint_dir)
        temp = checkpoint_dir / f"{_TEMP_PREFIX}{step:06d}-{os.getpid()}-{secrets.token_hex(4)}"
        temp.mkdir()
        with _committed_as(temp, final):
            fill(temp)
    prune_checkpoints(checkpoint_dir, keep)
    return final


def disk_full_fix(keep: int) -> str:
    return (
        f"free space there, keep fewer checkpoints ({KEEP_CHECKPOINTS_ENV}, now {keep}), or give the "
        "job's folder (the launcher's root) a larger filesystem; the earlier checkpoints are intact"
    )


def sharded_temp_folder(checkpoint_dir: Path, step: int) -> Path:
    """The hidden folder every rank writes its shard of ``step`` into: a name each rank computes alike."""
    return checkpoint_dir / f"{_TEMP_PREFIX}{checked_step(step):06d}-sharded"


def prepare_sharded_save(checkpoint_dir: Path, step: int, keep: int) -> Path:
    """Rank 0, before any rank writes: clear what killed saves left, make and return the hidden folder."""
    temp = sharded_temp_folder(checkpoint_dir, step)
    with disk_full_explained(temp, disk_full_fix(keep)):
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        _remove_hidden_folders(checkpoint_dir)
        temp.mkdir()
    return temp


def hash_step_files(folder: Path) -> dict[str, dict[str, Any]]:
    """``{name: {"sha256", "size"}}`` of every file in ``folder``, as a sharded step's metadata lists them."""
    return {
        entry.name: {"sha256": sha256_of(entry), "size": entry.stat().st_size}
        for entry in sorted(folder.iterdir())
    }


def commit_sharded_save(
    checkpoint_dir: Path, step: int, keep: int, files: dict[str, dict[str, Any]], save_seconds: float
) -> Path:
    """Rank 0, once every rank's shard is written and ``files`` hashed (``hash_step_files``): write
    ``metadata.json`` (last), rename the hidden folder into place, keep the newest ``keep`` steps;
    return the step folder. On failure the hidden folder goes and the earlier steps stay as they were."""
    temp = sharded_temp_folder(checkpoint_dir, step)
    final = checkpoint_dir / step_folder_name(step)
    with disk_full_explained(final, disk_full_fix(keep)), _committed_as(temp, final):
        listing = json.dumps(files, sort_keys=True).encode("utf-8")
        metadata = {
            "step": step,
            "sha256": hashlib.sha256(listing).hexdigest(),
            "size": sum(f["size"] for f in files.values()),
            "format": DCP_FORMAT,
            "files": files,
            "time": time.time(),
            "save_seconds": round(save_seconds, 6),
        }
        _write_metadata(temp, metadata)
    prune_checkpoints(checkpoint_dir, keep)
    return final


def discard_sharded_save(checkpoint_dir: Path, step: int) -> None:
    """Rank 0, after a failed sharded write: remove its hidden folder."""
    shutil.rmtree(sharded_temp_folder(checkpoint_dir, step), ignore_errors=True)


def commit_copied_step(checkpoint_dir: Path, source: Path, step: int, keep: int, names: list[str]) -> Path:
    """Rank 0: copy the files ``names`` of a whole-state step written elsewhere in this format (the
    memory tier's ``step-N``) into ``checkpoint_dir`` as ``step-N`` atomically, keep the newest
    ``keep`` steps; return the folder. On failure the earlier steps stay as they were."""

    def copy_into(temp: Path) -> None:
        for name in names:
            shutil.copyfile(source / name, temp / name)
            fsync_file(temp / name)
        fsync_dir(temp)

    return _commit_step(checkpoint_dir, checked_step(step), keep, copy_into)


def write_step_files(folder: Path, state: Any, step: int) -> str:
    """Write ``state`` as ``state.pt`` and ``metadata.json`` (last) into ``folder``, a step in this
    format anywhere (the memory tier writes its steps so); return the state's format. Raises
    ``CheckpointStateError`` as a save does."""
    _write_step_folder(folder, state, step)
    return str(json.loads((folder / METADATA_FILE).read_text(encoding="utf-8"))["format"])


def _write_metadata(folder: Path, metadata: dict[str, Any]) -> None:
    # Written last and fsynced: its presence is what makes the step count.
    metadata_path = folder / METADATA_FILE
    metadata_path.write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
    fsync_file(metadata_path)
    fsync_dir(folder)


def _write_step_folder(folder: Path, state: Any, step: int) -> None:
    state_path = folder / STATE_FILE
    started = time.monotonic()
    state_format, sha256 = _write_state(state_path, state)
    metadata = {
        "step": step,
        "sha256": sha256,
        "size": state_path.stat().st_size,
        "format": state_format,
        "time": time.time(),
        "save_seconds": round(time.monotonic() - started, 6),
    }
    _write_metadata(folder, metadata)


def _write_state(path: Path, state: Any) -> tuple[str, str]:
    """Write ``state`` to ``path`` and fsync it; returns its format and the sha256 of its bytes."""
    torch = None if isinstance(state, bytes | bytearray) else _import_torch()
    with open(path, "wb") as handle:
        hashing = _HashingWriter(handle)
        if torch is not None:
            torch.save(state, hashing)
            state_format = TORCH_FORMAT
        else:
            pickle.dump(state, hashing, protocol=pickle.HIGHEST_PROTOCOL)
            state_format = PICKLE_FORMAT
        handle.flush()
        os.fsync(handle.fileno())
    # Checked on the written file, before the step counts: a state saved today that no loader takes
    # would only fail at the resume that needs it.
    if torch is not None:
        refuse_unsafe_globals(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    else:
        refuse_unsafe_globals(_pickle_globals(path))
    return state_format, hashing.digest.hexdigest()


class _HashingWriter:
    """A file being written, hashing every byte on its way in, so the state is not read back after the
    write to hash it. Exact because both writers write strictly in order: ``torch.save`` into a file
    object needs only ``write`` and ``flush`` (it never seeks), and so does ``pickle.dump``; every
    load checks the file against this digest anyway."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()


def refuse_unsafe_globals(names: list[str]) -> None:
    """Raise ``CheckpointStateError`` when a state pickles classes or functions (``names``) that a
    ``weights_only`` (or, without torch, a globals-free) load would refuse."""
    if not names:
        return
    raise CheckpointStateError(
        f"the checkpoint state holds objects that loading it would refuse ({', '.join(sorted(names))}):"
        " loading runs no code from the checkpoint folder, so only tensors, numbers, strings, bytes and"
        " dicts/lists/tuples of them load; fix: convert them (a numpy array: torch.from_numpy(a) or"
        " a.tolist(); numpy's RNG: np.random.get_state()[1].tolist() and the ints beside it; a Path:"
        " str(p)), or, for classes you trust, call torch.serialization.add_safe_globals([...]) before"
        " both the save and the load"
    )


def _pickle_globals(path: Path) -> list[str]:
    """The globals (classes, functions) a pickle file names, read without unpickling it."""
    names = []
    strings: list[str] = []  # STACK_GLOBAL takes its module and name from the two strings before it
    with open(path, "rb") as handle:
        for opcode, arg, _ in pickletools.genops(handle):
            if isinstance(arg, str):
                strings.append(arg)
            if opcode.name in ("GLOBAL", "INST"):
                names.append(str(arg).replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL":
                names.append(".".join(strings[-2:]))
            elif opcode.name.startswith("EXT"):
                names.append(f"copyreg extension {arg}")
    return names


@contextlib.contextmanager
def _committed_as(temp: Path, final: Path) -> Iterator[None]:
    """The block fills the hidden folder ``temp``; then it becomes ``final``. On any failure (a full
    disk, an interrupt) ``temp`` goes and the earlier steps stay as they were."""
    try:
        yield
        _move_into_place(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def _move_into_place(temp: Path, final: Path) -> None:
    # os.replace cannot overwrite a non-empty folder: move the old one aside first. A crash in between
    # loses only this step; the older steps are still there to resume from.
    trash = _move_aside(final) if final.exists() else None
    os.replace(temp, final)
    fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _move_aside(folder: Path) -> Path:
    """Rename ``folder`` to a hidden trash name, so no reader sees it half deleted; return that name."""
    trash = folder.with_name(f"{_TRASH_PREFIX}{folder.name}-{secrets.token_hex(4)}")
    os.replace(folder, trash)
    return trash


def prune_checkpoints(checkpoint_dir: Path, keep: int) -> None:
    """Delete every step older than the ``keep`` newest valid ones, and stale hidden folders.

    Validity here checks the metadata and the state file's size, not its sha256: hashing every kept
    checkpoint on every save would reread gigabytes per epoch on a large model. Invalid steps newer
    than the kept ones are left alone (a resumed job overwrites them). Rank 0 only, never concurrently
    with a save into the same folder.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    _remove_hidden_folders(checkpoint_dir)
    valid_seen = 0
    for folder in _step_folders_newest_first(checkpoint_dir):
        if valid_seen >= keep:
            shutil.rmtree(_move_aside(folder), ignore_errors=True)
        elif isinstance(_inspect(folder, verify_checksum=False), CheckpointInfo):
            valid_seen += 1


def copy_newest_checkpoint(
    source_dir: Path, into_dir: Path, attempts: int = 3, *, before: int | None = None
) -> CheckpointInfo | None:
    """Copy the newest intact step of ``source_dir`` (below step ``before``, when given) into
    ``into_dir`` (as the same ``step-N``, through a hidden folder renamed into place) and return the
    copy, verified; None when the source has no such step. ``into_dir`` keeps one step at a time: a
    copy there already is returned as it is.

    The source may be a running job's checkpoint folder, whose rank 0 goes on saving and pruning: a
    step deleted while being copied is given up and the then newest one copied instead (``attempts``
    steps in all). A copy that fails while the source's files are still there (a full disk,
    permissions) raises ``shutil.Error``."""
    # Here, not at the top: only the orchestrator copies, and a training job need not import it.
    from tunepod import world

    with _copying_into(into_dir):
        existing = latest_checkpoint(into_dir) if into_dir.exists() else None
        if existing is not None:
            return existing
        for _ in range(attempts):
            source = next(
                (c for c in valid_checkpoints(source_dir) if before is None or c.step < before), None
            )
            if source is None:
                return None
            copied = _copy_step(source, into_dir, world.copy_file)
            if copied is not None:
                return copied
        return None


def _copying_into(into_dir: Path) -> contextlib.AbstractContextManager[bool]:
    """Held while copying into ``into_dir``. Two drivers of one trial (a stale one beside its lease's
    new holder) may copy into one folder at once, and each clears the hidden folders there first: one
    copy at a time, and the second returns the first's. The lock lies beside the folder, which keeps
    nothing but its step."""
    from tunepod import world

    return world.file_lock(into_dir.with_name(f".{into_dir.name}.copy-lock"))


def _copy_step(
    source: CheckpointInfo, into_dir: Path, copy_file: Callable[[str, str], object]
) -> CheckpointInfo | None:
    """``source`` copied whole into ``into_dir`` and verified; None when its job pruned it under the copy."""
    into_dir.mkdir(parents=True, exist_ok=True)
    _remove_hidden_folders(into_dir)
    final = into_dir / step_folder_name(source.step)
    temp = into_dir / f"{_TEMP_PREFIX}{source.step}-{secrets.token_hex(4)}"
    try:
        with _committed_as(temp, final):
            # Each file through the world: a simulated donor saves and prunes between two.
            shutil.copytree(source.path, temp, copy_function=copy_file)
            for path in temp.rglob("*"):
                if path.is_file():
                    fsync_file(path)
            fsync_dir(temp)
    except FileNotFoundError:
        return None  # pruned by its job before its files were listed
    except shutil.Error as failed:
        if not _lost_to_a_prune(failed):
            raise
        return None  # pruned by its job while its files were being copied
    copied = verified_checkpoint(into_dir, source.step)
    return copied if copied is not None and copied.step == source.step else None


def _lost_to_a_prune(failed: shutil.Error) -> bool:
    """Whether every file ``shutil.copytree`` failed to copy is gone from the source: its job pruned
    the step under the copy. ``copytree`` keeps only each cause's text, so the source is what tells: a
    file still there failed for a reason of its own (a full disk, permissions), which a retry would
    only repeat, and which must be seen."""
    entries = failed.args[0] if failed.args else None
    if not isinstance(entries, list) or not entries:
        return False  # not copytree's list of failed files (a same-file error carries a sentence)
    return all(
        isinstance(entry, tuple) and len(entry) == 3 and not os.path.lexists(entry[0]) for entry in entries
    )


def _remove_hidden_folders(checkpoint_dir: Path) -> None:
    """Delete what interrupted saves and removals left: no reader ever looks at those folders."""
    for entry in checkpoint_dir.iterdir():
        if entry.name.startswith((_TEMP_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)


def load_latest_checkpoint(checkpoint_dir: Path) -> Checkpoint | None:
    """Load the newest valid step, or ``None`` if there is none. Any rank may call it.

    Walks the steps newest to oldest; each invalid one (no metadata, wrong checksum, unreadable) is
    skipped with a warning on stderr naming the folder and the reason. The state is loaded onto the
    CPU with ``torch.load(weights_only=True)`` (tensors, containers and primitives only), a
    globals-free unpickler, or for a sharded step DCP into whole tensors, as its metadata says.
    """
    for found in _valid_with_warnings(checkpoint_dir):
        try:
            state = _read_state(found.path / STATE_FILE, found.format)
        except FileNotFoundError:
            _warn_skipped(found.path, "it was deleted while being loaded")
            continue
        return Checkpoint(step=found.step, state=state, path=found.path)
    return None


def newest_valid_checkpoint(checkpoint_dir: Path) -> CheckpointInfo | None:
    """The newest valid step (checksums verified); each newer invalid one is named on stderr."""
    return next(_valid_with_warnings(checkpoint_dir), None)


def read_whole_state(info: CheckpointInfo) -> Any:
    """The whole state of a step, on the CPU (of a sharded one: each tensor whole, in this process)."""
    return _read_state(info.path / STATE_FILE, info.format)


def _valid_with_warnings(checkpoint_dir: Path) -> Iterator[CheckpointInfo]:
    for folder in _step_folders_newest_first(checkpoint_dir):
        found = _inspect(folder, verify_checksum=True)
        if isinstance(found, str):
            _warn_skipped(folder, found)
        else:
            yield found


def latest_checkpoint(checkpoint_dir: Path) -> CheckpointInfo | None:
    """The newest valid step (checksum verified) without loading its state; for the orchestrator."""
    return next(valid_checkpoints(checkpoint_dir), None)


def valid_checkpoints(checkpoint_dir: Path) -> Iterator[CheckpointInfo]:
    """The valid steps, newest first, each checksum verified as it is reached; invalid ones skipped."""
    for folder in _step_folders_newest_first(checkpoint_dir):
        found = _inspect(folder, verify_checksum=True)
        if isinstance(found, CheckpointInfo):
            yield found


def saved_checkpoints(checkpoint_dir: Path) -> list[CheckpointInfo]:
    """The steps whose save completed, newest first, as their metadata says (each file's size checked,
    its sha256 not): the orchestrator's record of what a job left, at the job's end. Hashing them there
    would reread every kept state of every trial; whatever loads a step verifies it
    (``load_latest_checkpoint``, ``latest_checkpoint``, ``verified_checkpoint``)."""
    found = (saved_checkpoint(folder) for folder in _step_folders_newest_first(checkpoint_dir))
    return [info for info in found if info is not None]


def verified_checkpoint(checkpoint_dir: Path, step: int) -> CheckpointInfo | None:
    """Step ``step`` if it is intact (its sha256 verified), else the newest intact step before it;
    ``None`` when there is none. Each step it passes over is named on stderr with the reason."""
    for folder in _step_folders_newest_first(checkpoint_dir):
        if _folder_step(folder) > step:
            continue
        found = _inspect(folder, verify_checksum=True)
        if isinstance(found, CheckpointInfo):
            return found
        _warn_skipped(folder, found)
    return None


def saved_checkpoint(folder: Path) -> CheckpointInfo | None:
    """What the metadata of step folder ``folder`` says, if the save completed, without hashing the
    state: cheap enough for the orchestrator to poll. Use ``valid_checkpoints`` before trusting it."""
    found = _inspect(folder, verify_checksum=False)
    return found if isinstance(found, CheckpointInfo) else None


def step_folders(checkpoint_dir: Path) -> list[Path]:
    """The ``step-N`` folders under ``checkpoint_dir`` (complete or not), newest first."""
    return _step_folders_newest_first(checkpoint_dir)


def _step_folders_newest_first(checkpoint_dir: Path) -> list[Path]:
    try:
        entries = list(Path(checkpoint_dir).iterdir())
    except FileNotFoundError:
        return []
    steps = []
    for entry in entries:
        match = _STEP_FOLDER.match(entry.name)
        if match and entry.is_dir():
            steps.append((int(match.group(1)), entry))
    return [folder for _, folder in sorted(steps, reverse=True)]


def _folder_step(folder: Path) -> int:
    """The step in a ``step-N`` folder's name (one that ``_step_folders_newest_first`` listed)."""
    match = _STEP_FOLDER.match(folder.name)
    assert match is not None, folder
    return int(match.group(1))


def _inspect(folder: Path, verify_checksum: bool) -> CheckpointInfo | str:
    """The step's metadata if the folder is a valid checkpoint, else the reason it is not."""
    try:
        raw = json.loads((folder / METADATA_FILE).read_text(encoding="utf-8"))
        info = CheckpointInfo(
            step=int(raw["step"]),
            path=folder,
            sha256=str(raw["sha256"]),
            size=int(raw["size"]),
            format=str(raw["format"]),
            time=float(raw["time"]),
            save_seconds=_optional_float(raw.get("save_seconds")),
        )
    except FileNotFoundError:
        return f"no {METADATA_FILE} (the save did not complete)"
    except (OSError, ValueError, TypeError, KeyError) as exc:
        return f"unreadable {METADATA_FILE} ({exc!r})"
    if folder.name != step_folder_name(info.step):
        return f"{METADATA_FILE} says step {info.step}, which does not match the folder name"
    if info.format == DCP_FORMAT:
        try:
            listed = {str(name): (str(f["sha256"]), int(f["size"])) for name, f in raw["files"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            return f"unreadable files in {METADATA_FILE} ({exc!r})"
    else:
        listed = {STATE_FILE: (info.sha256, info.size)}
    for name, (sha256, size) in listed.items():
        problem = _file_problem(folder / name, sha256, size, verify_checksum)
        if problem is not None:
            return problem
    return info


def _file_problem(path: Path, sha256: str, size: int, verify_checksum: bool) -> str | None:
    """Why the file at ``path`` is not the one the metadata lists, or ``None`` when it is."""
    try:
        actual = path.stat().st_size
        if actual != size:
            return f"{path.name} has {actual} bytes, {METADATA_FILE} says {size}"
        if verify_checksum and sha256_of(path) != sha256:
            return f"{path.name} does not match the sha256 in {METADATA_FILE} (corrupted)"
    except FileNotFoundError:
        return f"no {path.name}"
    return None


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _read_state(path: Path, state_format: str) -> Any:
    if state_format == PICKLE_FORMAT:
        with open(path, "rb") as handle:
            return _GlobalsFreeUnpickler(handle, path).load()
    if state_format == DCP_FORMAT:
        if _import_torch() is None:
            raise RuntimeError(f"checkpoint {path.parent} is sharded (DCP), which needs torch to load")
        from tunepod.runtime import sharded  # imports torch.distributed.checkpoint

        return sharded.read_whole_state(path.parent)
    if state_format == TORCH_FORMAT:
        torch = _import_torch()
        if torch is None:
            raise RuntimeError(f"checkpoint {path} was saved with torch, which this environment lacks")
        return torch.load(path, map_location="cpu", weights_only=True)
    raise ValueError(f"checkpoint {path} has unknown format {state_format!r}")


class _GlobalsFreeUnpickler(pickle.Unpickler):
    """Loads bytes, numbers, strings and containers; refuses every class and function.

    Pickle runs code only through the objects ``find_class`` returns (a crafted ``__reduce__`` names a
    callable such as ``os.system``), so refusing all of them makes a pickle from a shared folder as
    harmless to load as JSON.
    """

    def __init__(self, handle: Any, path: Path) -> None:
        super().__init__(handle)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeCheckpointError(
            f"checkpoint {self._path} (format {PICKLE_FORMAT}) names {module}.{name}: loading it would"
            " run code, so it is not loaded (tunepod itself saves only plain data as pickle, so it was"
            " written by something else); fix: find out who can write that folder, delete the step, or"
            " if you trust it, load it yourself with pickle and save its state again as tensors"
        )


def _import_torch() -> types.ModuleType | None:
    # Imported here, not at the top: tunepod.runtime must import on images without torch.
    try:
        import torch
    except ImportError:
        return None
    return torch


def _warn_skipped(folder: Path, reason: str) -> None:
    print(f"tunepod.runtime: skipping checkpoint {folder}: {reason}", file=sys.stderr, flush=True)
