"""The memory tier's folders on one node, and the choice of the step a restore takes.

Layout on each node (``memory_dir`` is a tmpfs such as ``/dev/shm``)::

    <memory_dir>/tunepod/<job key>/          one job: the key is a hash of its checkpoint folder
        step-000060/
            state.pt, metadata.json          a whole-state step: rank 0's, in the shared step format
            .metadata, __0_0.distcp, ...     a sharded step: each rank's DCP files
            manifest-rank0.json              one per writer: its files (sha256, size), written last

A folder holds what the ranks of its node wrote and what peers pushed to it. Each writer first
removes its own manifest of the step, then writes its files (each under a hidden name, then renamed),
then its manifest, atomically: a manifest's presence means that writer's files are complete on that
node. Each manifest carries the attempt's ``nonce`` (rank 0 draws one per process group): a
restarted job trains the steps after its restored one again, and a step is complete only when every
writer's manifest is present somewhere with one nonce, so a stale attempt's files never mix with a
new one's. A kill at any point leaves the previous complete step loadable.

Standard library only; pure functions over folders and listings, so the rules are tested without
processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

from tunepod.runtime.checkpoints import step_folder_name

JOBS_FOLDER = "tunepod"
KEEP_MEMORY_STEPS = 2
_STEP_FOLDER = re.compile(r"^step-(\d+)$")
_MANIFEST = re.compile(r"^manifest-rank(\d+)\.json$")
# A file a step folder may hold: one path component, letters, digits, `_ . -`, at most one leading
# dot (DCP's `.metadata`). Hidden names being written (`.~...`) and anything else never match.
_FILE_NAME = re.compile(r"^\.?[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")
_WRITING_PREFIX = ".~"
_TRASH_PREFIX = ".trash-"

Tier = Literal["memory", "shared"]


class UnsafePathError(ValueError):
    """A request for a path outside a job's step folders (``..``, a nested or hidden name)."""


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    """What one writer wrote into a step folder; its presence means those files are complete there."""

    step: int
    writer: int
    writers: tuple[int, ...]
    """Every writer of the step (whole-state: rank 0 alone; sharded: every rank)."""
    format: str
    """The state's format: ``torch`` or ``pickle`` (whole-state, as in metadata.json) or ``dcp``."""
    nonce: str
    time: float
    files: dict[str, FileEntry]

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True, indent=1) + "\n").encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        return cls(
            step=int(raw["step"]),
            writer=int(raw["writer"]),
            writers=tuple(int(w) for w in raw["writers"]),
            format=str(raw["format"]),
            nonce=str(raw["nonce"]),
            time=float(raw["time"]),
            files={str(n): FileEntry(str(f["sha256"]), int(f["size"])) for n, f in raw["files"].items()},
        )


def manifest_name(writer: int) -> str:
    return f"manifest-rank{writer}.json"


def job_key(checkpoint_dir: Path) -> str:
    """A short name for a job's memory folder: the same for every restart of one trial (its
    checkpoint folder does not change), different for two trials sharing a node."""
    return hashlib.sha256(str(Path(checkpoint_dir).resolve()).encode("utf-8")).hexdigest()[:16]


def job_folder(memory_dir: Path | str, checkpoint_dir: Path) -> Path:
    return Path(memory_dir) / JOBS_FOLDER / job_key(checkpoint_dir)


def step_file(job: Path, step_name: str, file_name: str) -> Path:
    """``job/step_name/file_name``, refusing anything but a step folder and a plain file name in it,
    so a peer's request can never reach outside the job's folder."""
    if not _STEP_FOLDER.match(step_name) or not _FILE_NAME.match(file_name) or ".." in file_name:
        raise UnsafePathError(f"not a step file: {step_name!r}/{file_name!r}")
    return job / step_name / file_name


def request_path(job: Path, url_path: str) -> Path:
    """The file a peer's URL path (``/step-000060/state.pt``) names under ``job``."""
    parts = url_path.split("?", 1)[0].strip("/").split("/")
    if len(parts) != 2:
        raise UnsafePathError(f"not a step file: {url_path!r}")
    return step_file(job, parts[0], parts[1])


@contextlib.contextmanager
def writing(path: Path) -> Iterator[BinaryIO]:
    """A handle on a hidden name beside ``path``, renamed to ``path`` when the block ends: readers see
    the whole file or none. On failure the hidden file goes."""
    temp = path.with_name(f"{_WRITING_PREFIX}{path.name}.{secrets.token_hex(4)}")
    try:
        with open(temp, "wb") as handle:
            yield handle
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def write_file(path: Path, data: bytes) -> None:
    with writing(path) as handle:
        handle.write(data)


def begin_writing(folder: Path, writer: int, own_files: list[str]) -> None:
    """Before ``writer`` writes its files of a step: remove its manifest first (so the files it
    overwrites never sit under a manifest that lists their old checksums), then those files."""
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / manifest_name(writer))
    for name in own_files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / name)


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Written last, atomically: from now on ``manifest.writer``'s files count as complete here."""
    write_file(folder / manifest_name(manifest.writer), manifest.to_bytes())


@dataclass(frozen=True)
class StepListing:
    """One step folder of one node: its manifests and the sizes of its files."""

    manifests: dict[int, Manifest] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)


def list_job_folder(job: Path) -> dict[int, StepListing]:
    """The step folders of ``job`` on this node; unreadable manifests are left out (as if absent)."""
    listing: dict[int, StepListing] = {}
    for folder in _step_folders(job):
        found = StepListing()
        try:
            entries = list(folder.iterdir())
        except FileNotFoundError:
            continue  # pruned while listed
        for entry in entries:
            if not _FILE_NAME.match(entry.name):
                continue
            with contextlib.suppress(FileNotFoundError):
                found.sizes[entry.name] = entry.stat().st_size
                match = _MANIFEST.match(entry.name)
                if match:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        manifest = Manifest.from_bytes(entry.read_bytes())
                        if manifest.writer == int(match.group(1)):
                            found.manifests[manifest.writer] = manifest
        listing[_folder_step(folder)] = found
    return listing


@dataclass(frozen=True)
class RestorePlan:
    """The step a restore takes and where its files are: the same on every rank."""

    step: int
    tier: Tier
    newest_shared: int | None
    """The newest shared step (the schedule counts the next shared save from it)."""
    nonce: str = ""
    format: str = ""
    files: dict[str, FileEntry] = field(default_factory=dict)
    writer_of: dict[str, int] = field(default_factory=dict)
    holders: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Writer -> the nodes holding that writer's files complete (its manifest and every file)."""

    def files_of(self, writer: int) -> list[str]:
        return sorted(name for name, w in self.writer_of.items() if w == writer)


def choose_restore(
    nodes: Mapping[int, Mapping[int, StepListing]], newest_shared: int | None
) -> RestorePlan | None:
    """The newest step complete in the memory of the live ``nodes`` (node -> its listing), or the
    shared step when that is newer or none is complete; ``None`` when there is neither.

    A step is complete when, for one nonce, every writer its manifests name has its manifest and all
    its files (at the listed sizes) on at least one node. Checksums are verified by whoever reads a
    file. Two complete attempts of one step: the later written one.
    """
    steps = sorted({step for listing in nodes.values() for step in listing}, reverse=True)
    for step in steps:
        if newest_shared is not None and newest_shared > step:
            break
        plan = _complete_plan(step, nodes, newest_shared)
        if plan is not None:
            return plan
    if newest_shared is None:
        return None
    return RestorePlan(step=newest_shared, tier="shared", newest_shared=newest_shared)


def _complete_plan(
    step: int, nodes: Mapping[int, Mapping[int, StepListing]], newest_shared: int | None
) -> RestorePlan | None:
    attempts: dict[str, list[tuple[int, Manifest]]] = {}
    for node, listing in sorted(nodes.items()):
        for manifest in listing.get(step, StepListing()).manifests.values():
            attempts.setdefault(manifest.nonce, []).append((node, manifest))
    complete = [
        plan
        for nonce, held in attempts.items()
        if (plan := _plan_of(step, nonce, held, nodes, newest_shared)) is not None
    ]
    return max(complete, key=lambda plan: _written_at(plan, attempts), default=None)


def _plan_of(
    step: int,
    nonce: str,
    held: list[tuple[int, Manifest]],
    nodes: Mapping[int, Mapping[int, StepListing]],
    newest_shared: int | None,
) -> RestorePlan | None:
    writers = {manifest.writers for _, manifest in held}
    formats = {manifest.format for _, manifest in held}
    if len(writers) != 1 or len(formats) != 1:
        return None  # manifests of one attempt that disagree: not a step this code wrote
    holders: dict[int, list[int]] = {}
    files: dict[str, FileEntry] = {}
    writer_of: dict[str, int] = {}
    for node, manifest in held:
        sizes = nodes[node][step].sizes
        if all(sizes.get(name) == entry.size for name, entry in manifest.files.items()):
            holders.setdefault(manifest.writer, []).append(node)
            files.update(manifest.files)
            writer_of.update(dict.fromkeys(manifest.files, manifest.writer))
    (all_writers,) = writers
    if any(writer not in holders for writer in all_writers):
        return None
    return RestorePlan(
        step=step,
        tier="memory",
        newest_shared=newest_shared,
        nonce=nonce,
        format=formats.pop(),
        files=files,
        writer_of=writer_of,
        holders={writer: tuple(sorted(set(on))) for writer, on in holders.items()},
    )


def _written_at(plan: RestorePlan, attempts: Mapping[str, list[tuple[int, Manifest]]]) -> float:
    return max(manifest.time for _, manifest in attempts[plan.nonce])


def prune_job_folder(job: Path, nonce: str, keep: int = KEEP_MEMORY_STEPS) -> None:
    """Delete the step folders older than the ``keep`` newest that hold a manifest of this attempt
    (``nonce``), and what killed writes and removals left.

    Safe beside writers and peers' pushes: the ranks save in step (a save of step N starts only once
    every rank finished step N-1, pushes included), so by the time a step holds this attempt's
    manifest the step before it is complete everywhere, and nothing writes into older steps.
    """
    _remove_trash(job)
    held = [folder for folder in _step_folders(job) if any(m.nonce == nonce for m in _manifests_in(folder))]
    if len(held) < keep:
        return
    oldest_kept = _folder_step(held[keep - 1])
    for folder in _step_folders(job):
        if _folder_step(folder) < oldest_kept:
            remove_folder(folder)


def remove_folder(folder: Path) -> None:
    """Move ``folder`` aside under a hidden name (so no listing sees it half deleted), then delete it."""
    trash = folder.with_name(f"{_TRASH_PREFIX}{folder.name}-{secrets.token_hex(4)}")
    try:
        os.replace(folder, trash)
    except FileNotFoundError:
        return  # another process removed it first
    shutil.rmtree(trash, ignore_errors=True)


def step_folder(job: Path, step: int) -> Path:
    return job / step_folder_name(step)


def _manifests_in(folder: Path) -> list[Manifest]:
    found = []
    for path in folder.glob("manifest-rank*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            found.append(Manifest.from_bytes(path.read_bytes()))
    return found


def _remove_trash(job: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        for entry in job.iterdir():
            if entry.name.startswith(_TRASH_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)


def _step_folders(job: Path) -> list[Path]:
    """The ``step-N`` folders of ``job``, newest first."""
    try:
        entries = list(job.iterdir())
    except FileNotFoundError:
        return []
    steps = [(int(m.group(1)), e) for e in entries if (m := _STEP_FOLDER.match(e.name)) and e.is_dir()]
    return [folder for _, folder in sorted(steps, reverse=True)]


def _folder_step(folder: Path) -> int:
    match = _STEP_FOLDER.match(folder.name)
    assert match is not None, folder
    return int(match.group(1))
