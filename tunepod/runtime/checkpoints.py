"""Checkpoints in ``step-N`` folders that are either whole or ignored (after torchtitan).

Layout under the job's checkpoint folder::

    step-000007/
        state.pt        the state: torch.save when torch is importable and the state is not bytes,
                        else pickle (``format`` in the metadata says which)
        metadata.json   {"step", "sha256", "size", "format", "time", "save_seconds"}, written last

``save_seconds`` is how long writing, fsyncing and hashing the state took (the rename that follows is
not counted); the orchestrator reads it for its checkpoint metric, since a training job never imports
prometheus-client. Checkpoints written before it existed have none.

A step counts only when its ``metadata.json`` exists and the state file matches its size and sha256.
A save writes everything into a hidden temporary folder next to the final one, fsyncs the files and
the folder, then renames it into place, so a job killed mid-save leaves a hidden folder that every
reader ignores and the next save deletes before it writes (so the leftover never costs that save its
space). A save that finds the filesystem full removes what it wrote and raises ``DiskFullError``.

Ownership: only rank 0 saves (one writer per checkpoint folder); any rank, and the orchestrator, may
read at any time.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import secrets
import shutil
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunepod.runtime.contract import KEEP_CHECKPOINTS_ENV
from tunepod.runtime.files import disk_full_explained, fsync_dir, fsync_file, sha256_of
from tunepod.runtime.metrics import checked_step

STATE_FILE = "state.pt"
METADATA_FILE = "metadata.json"
TORCH_FORMAT = "torch"
PICKLE_FORMAT = "pickle"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")
# Hidden prefixes of folders that are never a checkpoint: a save in progress and a step being removed.
_TEMP_PREFIX = ".tmp-step-"
_TRASH_PREFIX = ".trash-step-"


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
    final = checkpoint_dir / step_folder_name(step)
    fix = (
        f"free space there, keep fewer checkpoints ({KEEP_CHECKPOINTS_ENV}, now {keep}), or give the "
        "job's folder (the launcher's root) a larger filesystem; the earlier checkpoints are intact"
    )
    with disk_full_explained(final, fix):
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        # A save killed mid-write left its hidden folder, as large as a state: on a nearly full
        # filesystem it would make this save fail, so it goes before anything is written.
        _remove_hidden_folders(checkpoint_dir)
        temp = checkpoint_dir / f"{_TEMP_PREFIX}{step:06d}-{os.getpid()}-{secrets.token_hex(4)}"
        temp.mkdir()
        try:
            _write_step_folder(temp, state, step)
            _move_into_place(temp, final)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
    prune_checkpoints(checkpoint_dir, keep)
    return final


def _write_step_folder(folder: Path, state: Any, step: int) -> None:
    state_path = folder / STATE_FILE
    started = time.monotonic()
    state_format = _write_state(state_path, state)
    sha256 = sha256_of(state_path)
    metadata = {
        "step": step,
        "sha256": sha256,
        "size": state_path.stat().st_size,
        "format": state_format,
        "time": time.time(),
        "save_seconds": round(time.monotonic() - started, 6),
    }
    # Written last and fsynced: its presence is what makes the step count.
    metadata_path = folder / METADATA_FILE
    metadata_path.write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
    fsync_file(metadata_path)
    fsync_dir(folder)


def _write_state(path: Path, state: Any) -> str:
    torch = None if isinstance(state, bytes | bytearray) else _import_torch()
    with open(path, "wb") as handle:
        if torch is not None:
            torch.save(state, handle)
            state_format = TORCH_FORMAT
        else:
            pickle.dump(state, handle, protocol=pickle.HIGHEST_PROTOCOL)
            state_format = PICKLE_FORMAT
        handle.flush()
        os.fsync(handle.fileno())
    return state_format


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


def _remove_hidden_folders(checkpoint_dir: Path) -> None:
    """Delete what interrupted saves and removals left: no reader ever looks at those folders."""
    for entry in checkpoint_dir.iterdir():
        if entry.name.startswith((_TEMP_PREFIX, _TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)


def load_latest_checkpoint(checkpoint_dir: Path) -> Checkpoint | None:
    """Load the newest valid step, or ``None`` if there is none. Any rank may call it.

    Walks the steps newest to oldest; each invalid one (no metadata, wrong checksum, unreadable) is
    skipped with a warning on stderr naming the folder and the reason. The state is loaded onto the
    CPU with ``torch.load(weights_only=True)`` (tensors, containers and primitives only) or pickle,
    as its metadata says.
    """
    for folder in _step_folders_newest_first(checkpoint_dir):
        found = _inspect(folder, verify_checksum=True)
        if isinstance(found, str):
            _warn_skipped(folder, found)
            continue
        try:
            state = _read_state(folder / STATE_FILE, found.format)
        except FileNotFoundError:
            _warn_skipped(folder, "it was deleted while being loaded")
            continue
        return Checkpoint(step=found.step, state=state, path=folder)
    return None


def latest_checkpoint(checkpoint_dir: Path) -> CheckpointInfo | None:
    """The newest valid step (checksum verified) without loading its state; for the orchestrator."""
    return next(valid_checkpoints(checkpoint_dir), None)


def valid_checkpoints(checkpoint_dir: Path) -> Iterator[CheckpointInfo]:
    """The valid steps, newest first, each checksum verified as it is reached; invalid ones skipped."""
    for folder in _step_folders_newest_first(checkpoint_dir):
        found = _inspect(folder, verify_checksum=True)
        if isinstance(found, CheckpointInfo):
            yield found


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
    try:
        size = (folder / STATE_FILE).stat().st_size
        if size != info.size:
            return f"{STATE_FILE} has {size} bytes, {METADATA_FILE} says {info.size}"
        if verify_checksum and sha256_of(folder / STATE_FILE) != info.sha256:
            return f"{STATE_FILE} does not match the sha256 in {METADATA_FILE} (corrupted)"
    except FileNotFoundError:
        return f"no {STATE_FILE}"
    return info


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _read_state(path: Path, state_format: str) -> Any:
    if state_format == PICKLE_FORMAT:
        with open(path, "rb") as handle:
            return pickle.load(handle)
    if state_format == TORCH_FORMAT:
        torch = _import_torch()
        if torch is None:
            raise RuntimeError(f"checkpoint {path} was saved with torch, which this environment lacks")
        return torch.load(path, map_location="cpu", weights_only=True)
    raise ValueError(f"checkpoint {path} has unknown format {state_format!r}")


def _import_torch() -> types.ModuleType | None:
    # Imported here, not at the top: tunepod.runtime must import on images without torch.
    try:
        import torch
    except ImportError:
        return None
    return torch


def _warn_skipped(folder: Path, reason: str) -> None:
    print(f"tunepod.runtime: skipping checkpoint {folder}: {reason}", file=sys.stderr, flush=True)
