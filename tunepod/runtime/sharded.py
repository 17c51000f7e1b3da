"""Sharded checkpoints: every rank writes its own shard with torch.distributed.checkpoint (DCP).

A save, on every rank: rank 0 clears what killed saves left and makes the step's hidden folder; every
rank agrees it exists; each rank writes its shard there (``dcp.save``, or ``dcp.async_save``, which
copies the state to CPU memory and writes it in the background while training goes on); rank 0 then
commits: hashes DCP's files into ``metadata.json``, renames the folder to ``step-N``, keeps the
newest K (``checkpoints.commit_sharded_save``). An async save is committed by the next save, by
``wait``, or by ``finish``. Rank 0 knows every shard is written when its own DCP future is done:
DCP ends a save by gathering every rank's write result on rank 0 (files fsynced) and writing its
``.metadata`` there, so rank 0's future cannot resolve before the last rank has written; a rank whose
write failed makes every rank's future raise, and nothing is committed. A kill at any point before
the rename leaves a hidden folder that readers ignore and the next save deletes.

A load, on every rank: rank 0 picks the newest valid step (checksums verified) and tells the others;
each rank reads the parts of the tensors it holds into the caller's state dict (``dcp.load``), so a
DTensor sharded over N ranks loads onto M ranks, and plain tensors load anywhere. DCP's own reader
unpickles ``.metadata`` and ``torch.load``s non-tensor values with ``weights_only=False``; both would
run code from the shared folder, so here ``.metadata`` is read by an unpickler that allows only DCP's
metadata classes and values load with ``weights_only=True``.

The collectives run on a gloo group of their own, made at the first use, so an async write's
collectives in the background never interleave with the training loop's on the default group.
"""

from __future__ import annotations

import io
import itertools
import pickle
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse, async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from tunepod.runtime import checkpoints
from tunepod.runtime.checkpoints import Checkpoint, UnsafeCheckpointError
from tunepod.runtime.files import disk_full_error

T = TypeVar("T")
ASYNC_MODES = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}


@dataclass
class _PendingSave:
    step: int
    started: float
    settled: Future[None] = field(default_factory=Future)
    """Resolves once every rank's shard is written and, on rank 0, the step is committed."""
    write_failed: bool = False
    """DCP's write failed (on every rank alike), as opposed to rank 0's commit."""

    def follow(self, write: Future[Any], commit: Callable[[float], None] | None) -> None:
        """Resolve ``settled`` when DCP's ``write`` does, after ``commit`` (rank 0: hash the
        shards, write the metadata, rename into place, prune) with the seconds the save took.

        Runs as ``write``'s callback: in DCP's writer thread for an async save, so the commit,
        hashing and deleting the oldest step included, never stalls the training loop."""

        def done(finished: Future[Any]) -> None:
            try:
                finished.result()
            except BaseException as exc:  # raised by wait(), on the training thread
                self.write_failed = True
                self.settled.set_exception(exc)
                return
            try:
                if commit is not None:
                    commit(time.monotonic() - self.started)
            except BaseException as exc:
                self.settled.set_exception(exc)
                return
            self.settled.set_result(None)

        write.add_done_callback(done)


class ShardedCheckpointer:
    """Saves and loads sharded steps under ``checkpoint_dir``; one per process, used from the thread
    that runs the training loop. Every method is a collective: call it on every rank alike."""

    def __init__(self, checkpoint_dir: Path, keep: int, world_size: int = 1) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.keep = keep
        self.world_size = world_size
        """The job's number of processes (its contract's ``WORLD_SIZE``)."""
        self._group: dist.ProcessGroup | None = None
        self._pending: _PendingSave | None = None
        self._stagers: dict[str, DefaultStager] = {}

    def save(self, state: dict[str, Any], step: int, async_mode: str | None) -> Path:
        """Write ``state`` as step ``step`` (async: in the background, committed later); return the
        step folder (for an async save, where the next save, ``wait`` or ``finish`` will put it)."""
        if self.world_size > 1 and not self._distributed():
            # Each process would write a world of one into the same folder, over the others' files.
            raise RuntimeError(
                f"a sharded save in a job of {self.world_size} processes needs torch.distributed:"
                " fix: call torch.distributed.init_process_group() on every rank before saving"
            )
        self.wait()  # one save in flight at most, committed in order
        started = time.monotonic()
        rank0 = self._rank() == 0

        def prepare() -> None:
            refuse_unloadable_values(state)
            if rank0:
                checkpoints.prepare_sharded_save(self.checkpoint_dir, step, self.keep)

        # One agreement for both: the state is saveable everywhere and rank 0 made the step's folder.
        self._on_every_rank("save this state (or prepare its folder)", prepare)
        temp = checkpoints.sharded_temp_folder(self.checkpoint_dir, step)
        writer = FileSystemWriter(temp, sync_files=True)
        distributed = self._distributed()
        group = self._checkpoint_group() if distributed else None
        write: Future[Any]
        if async_mode is None:
            write = Future()
            try:  # the outcome goes to wait(), which raises a failure on every rank alike
                write.set_result(
                    dcp_save(state, storage_writer=writer, process_group=group, no_dist=not distributed)
                )
            except BaseException as exc:
                write.set_exception(exc)
        else:
            response = async_save(
                state,
                storage_writer=writer,
                process_group=group,
                no_dist=not distributed,
                async_checkpointer_type=ASYNC_MODES[async_mode],
                async_stager=self._stager(async_mode),
            )
            write = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        self._pending = _PendingSave(step, started)
        self._pending.follow(write, self._committer(step, temp) if rank0 else None)
        final = self.checkpoint_dir / checkpoints.step_folder_name(step)
        if async_mode is None:
            self.wait()
        return final

    def wait(self) -> Path | None:
        """Wait for the save in flight, if any, to be written and committed; return its step folder."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.settled.exception()  # waits for the write (and rank 0's commit); raises nothing
        # DCP gathered every rank's write outcome, so a failed write raises on every rank alike; a
        # failed commit (rank 0 only) is agreed on here, so no rank goes on alone.
        self._on_every_rank(f"commit step {pending.step}", lambda: self._settled(pending))
        return self.checkpoint_dir / checkpoints.step_folder_name(pending.step)

    def _settled(self, pending: _PendingSave) -> None:
        """Raise what became of ``pending`` on this rank: its write's or its commit's error."""
        exc = pending.settled.exception()
        if exc is None:
            return
        if pending.write_failed:
            if self._rank() == 0:
                checkpoints.discard_sharded_save(self.checkpoint_dir, pending.step)
            full = _disk_full(exc, self.checkpoint_dir, pending.step, self.keep)
            if full is not None:
                raise full from exc
        raise exc

    def _committer(self, step: int, temp: Path) -> Callable[[float], None]:
        """Rank 0's commit of ``step`` once every shard is written: hash, metadata, rename, prune."""

        def commit(seconds: float) -> None:
            files = checkpoints.hash_step_files(temp)
            checkpoints.commit_sharded_save(self.checkpoint_dir, step, self.keep, files, seconds)

        return commit

    def _stager(self, async_mode: str) -> DefaultStager:
        """The copy-to-CPU stager of ``async_mode``, kept across saves so each save refills the CPU
        buffers of the last instead of allocating new ones (DCP's default makes a new copy each
        time: measured at up to half of an async save's stall). Shared memory for the process mode,
        whose writer process then reads the buffers without another copy; pinned with CUDA."""
        if async_mode not in self._stagers:
            self._stagers[async_mode] = reusable_stager(shared_memory=async_mode == "process")
        return self._stagers[async_mode]

    def load_latest(self, into: dict[str, Any]) -> Checkpoint | None:
        """Load the newest valid step into ``into`` (its tensors are filled in place, its other values
        replaced) and return it, or ``None`` for a fresh start. A non-sharded step returns its whole
        state, as ``checkpoints.load_latest_checkpoint`` does, and leaves ``into`` alone."""
        self.wait()
        info = self._on_rank0(
            "pick the checkpoint", lambda: checkpoints.newest_valid_checkpoint(self.checkpoint_dir)
        )
        step = self._broadcast_step(None if info is None else info.step)
        if step is None:
            return None
        return self.load_step(into, step, info)

    def load_step(
        self, into: dict[str, Any], step: int, info: checkpoints.CheckpointInfo | None = None
    ) -> Checkpoint:
        """Load shared step ``step``, which every rank agreed on, as ``load_latest`` does."""
        folder = self.checkpoint_dir / checkpoints.step_folder_name(step)
        info = info or checkpoints.saved_checkpoint(folder)
        if info is None:
            raise RuntimeError(f"rank 0 picked {folder}, which this rank cannot read; is the folder shared?")
        if info.format != checkpoints.DCP_FORMAT:
            return Checkpoint(step=step, state=checkpoints.read_whole_state(info), path=folder)
        self.load_into(into, SafeReader(folder))
        return Checkpoint(step=step, state=into, path=folder)

    def load_into(self, into: dict[str, Any], reader: FileSystemReader) -> None:
        """Every rank: DCP-load into ``into`` through ``reader`` (a ``SafeReader``)."""
        # Checked here too, so a forged .metadata raises UnsafeCheckpointError itself, not wrapped
        # in DCP's CheckpointException (a BaseException that skips `except Exception`).
        reader.read_metadata()
        distributed = self._distributed()
        dcp_load(
            into,
            storage_reader=reader,
            planner=_SafeLoadPlanner(),
            process_group=self._checkpoint_group() if distributed else None,
            no_dist=not distributed,
        )

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _rank(self) -> int:
        return dist.get_rank() if self._distributed() else 0

    def _checkpoint_group(self) -> dist.ProcessGroup:
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _on_rank0(self, what: str, action: Callable[[], T]) -> T | None:
        """Run ``action`` on rank 0 and make every rank agree it worked (a barrier too)."""
        return self._on_every_rank(what, action, self._rank() == 0)

    def _on_every_rank(self, what: str, action: Callable[[], T], runs_here: bool = True) -> T | None:
        """Run ``action`` (where ``runs_here``) and make every rank agree whether it worked on all: a
        failing rank raises its own error, the others one that points at the other ranks' logs, so
        no rank goes on into a collective that a failed one will never join."""
        result: T | None = None
        error: BaseException | None = None
        if runs_here:
            try:
                result = action()
            # Raised below, once the other ranks know. BaseException: DCP's CheckpointException is one.
            except BaseException as exc:
                error = exc
        if self._distributed():
            failed = torch.tensor([0 if error is None else 1], dtype=torch.int32)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self._checkpoint_group())
            if error is None and failed.item():
                raise RuntimeError(f"another rank could not {what} under {self.checkpoint_dir}; see its log")
        if error is not None:
            raise error
        return result

    def _broadcast_step(self, step: int | None) -> int | None:
        if not self._distributed():
            return step
        picked = torch.tensor([-1 if step is None else step], dtype=torch.int64)
        dist.broadcast(picked, src=0, group=self._checkpoint_group())
        value = int(picked.item())
        return None if value < 0 else value


def reusable_stager(shared_memory: bool = False) -> DefaultStager:
    """A stager that copies a state to CPU memory on the calling thread, into the buffers of its last
    copy when the state's tensors are the same (a model's parameters, an optimizer's moments); pinned
    with CUDA. ``shared_memory`` for a writer process that reads the buffers without another copy."""
    cuda = torch.cuda.is_available()
    options = StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=shared_memory,
        use_async_staging=False,  # the training loop may change the state once save returns
        use_non_blocking_copy=cuda,
    )
    return DefaultStager(options)


def read_whole_state(folder: Path, reader: FileSystemReader | None = None) -> dict[str, Any]:
    """The whole state of sharded step ``folder`` in this process alone, each tensor whole and on the
    CPU (a DTensor comes back as a plain tensor): for an evaluation or export that has no model built
    yet (its config is in the state). Needs memory for all of it; a resume loads ``into`` instead."""
    reader = reader or SafeReader(folder)
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {
        fqn: torch.empty(item.size, dtype=item.properties.dtype)
        if isinstance(item, TensorStorageMetadata)
        else None
        for fqn, item in metadata.state_dict_metadata.items()
    }
    with warnings.catch_warnings():  # no_dist is the point here, not a fallback worth a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(flat, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=True)
    return _nested(flat, metadata.planner_data or {})


def _nested(flat: dict[str, Any], paths: Mapping[str, Any]) -> dict[str, Any]:
    """``flat`` (DCP's dotted keys) put back in the nesting it was saved with: ``paths`` maps each key
    to its path of dict keys (str) and list indices (int), as DCP's metadata records them."""
    root: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = tuple(paths.get(fqn, (fqn,)))
        node: Any = root
        for key, next_key in itertools.pairwise(path):
            empty: Any = [] if isinstance(next_key, int) else {}
            if isinstance(node, list):
                node.extend([None] * (key + 1 - len(node)))
                node[key] = empty if node[key] is None else node[key]
            else:
                node.setdefault(key, empty)
            node = node[key]
        if isinstance(node, list):
            node.extend([None] * (path[-1] + 1 - len(node)))
        node[path[-1]] = value
    return root


def async_mode_of(async_save: bool | str) -> str | None:
    """``None`` for a synchronous save, else the key of ``ASYNC_MODES``; ``True`` means a thread."""
    mode = "thread" if async_save is True else async_save or None
    if mode is not None and mode not in ASYNC_MODES:
        raise ValueError(f"async_save={async_save!r}; valid: False, True, 'thread', 'process'")
    return mode if isinstance(mode, str) else None


def refuse_unloadable_values(state: Mapping[str, Any]) -> None:
    """Raise ``CheckpointStateError`` when a non-tensor value of ``state`` (DCP saves each with
    ``torch.save``) would be refused by the ``weights_only`` load of a resume."""
    values = list(_non_tensor_values(state))
    if not values:
        return
    buffer = io.BytesIO()
    torch.save(values, buffer)
    buffer.seek(0)
    checkpoints.refuse_unsafe_globals(torch.serialization.get_unsafe_globals_in_checkpoint(buffer))


def _non_tensor_values(value: Any, top: bool = True) -> Iterator[Any]:
    if isinstance(value, torch.Tensor):
        return
    if isinstance(value, Mapping):
        for item in value.values():
            # DCP asks a top-level Stateful (a model, an optimizer wrapper) for its state_dict.
            state = item.state_dict() if top and isinstance(item, Stateful) else item
            yield from _non_tensor_values(state, False)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _non_tensor_values(item, False)
    else:
        yield value


def _disk_full(exc: BaseException, checkpoint_dir: Path, step: int, keep: int) -> BaseException | None:
    """The ``DiskFullError`` for a full disk met by any rank's write (DCP wraps each rank's error in
    a ``CheckpointException``), or ``None`` for any other failure."""
    failures = getattr(exc, "failures", {})
    for failure in [exc, *(f[0] if isinstance(f, tuple) else f for f in failures.values())]:
        if isinstance(failure, BaseException):
            folder = checkpoint_dir / checkpoints.step_folder_name(step)
            error = disk_full_error(failure, folder, checkpoints.disk_full_fix(keep))
            if error is not None:
                return error
    return None


class SafeReader(FileSystemReader):
    """DCP's file reader with a ``.metadata`` unpickler that allows only DCP's own metadata types."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle, path).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor values load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        # Handed on re-saved: the parent's own placement logic, fed bytes that can hold nothing unsafe.
        again = io.BytesIO()
        torch.save(loaded, again)
        again.seek(0)
        super().load_bytes(read_item, again)


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, handle: Any, path: Path) -> None:
        super().__init__(handle)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._path} names {module}.{name}, which is not part of DCP's metadata: loading it could"
            " run code, so the checkpoint is not loaded; fix: find out who wrote that folder and delete"
            " the step (or, if a newer torch wrote it, load it with that torch's version)"
        )
