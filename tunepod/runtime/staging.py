"""The copy of a checkpoint's state to CPU buffers on the training thread: what an async sharded save
and a memory-tier save stall training for.

A save returns only once its state is copied, because the training loop may change the state as
soon as save returns; the background writer then reads the copy. So the copy is the floor of the
stall: one pass over the state's bytes at the memory bandwidth the training thread gets (on CPU), or
a device-to-host copy into pinned memory (with CUDA).

``ReusableStager`` makes that copy and little else. Its CPU buffers are allocated at the first save
and refilled by the next ones (one per source storage, for as long as that storage lives: a model's
parameters, an optimizer's moments), so a save touches no fresh pages; the state's containers are
rebuilt around the buffers (dicts keep their type and attributes, such as a ``state_dict``'s
``_metadata``); the bytes are copied storage by storage, split over ``num_threads`` threads (torch
releases the GIL in ``copy_``) when the process has CPUs to spare. Views keep their offsets and
tensors that share a storage share its copy, as with ``torch.save``. A state with anything else in
it (a tensor subclass such as a DTensor, a sparse or quantized tensor, an object that is not a
container or a plain value) is staged by DCP's ``DefaultStager`` instead, which knows those.

The caller owns the timing: the buffers of one ``stage`` are overwritten by the next, so the
writer of a save must be done with them before the next save stages (the memory tier and the
sharded checkpointer wait for the save in flight first). Not thread-safe: one training thread.

torch is imported here: import this module only when a checkpoint is saved.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.utils.weak import WeakIdKeyDictionary

#: Most threads one process copies with: a few saturate a socket's memory bandwidth.
MAX_COPY_THREADS = 4
#: Bytes a copy thread gets at least: below this a thread's start-up costs more than it saves.
MIN_BYTES_PER_THREAD = 16 << 20
_Pair = tuple[torch.UntypedStorage, torch.UntypedStorage]  # (buffer, source)
_ATOMIC = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class _Unsupported(Exception):
    """The state holds something only DCP's stager copies faithfully."""


def copy_threads(env: Mapping[str, str]) -> int:
    """The copy threads a process of the job in ``env`` can use: the CPUs it may run on, shared with
    the other processes of its node (``LOCAL_WORLD_SIZE``, as torchrun sets it), at most
    ``MAX_COPY_THREADS``."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        local_world_size = max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:
        local_world_size = 1
    return max(1, min(MAX_COPY_THREADS, cpus // local_world_size))


class ReusableStager:
    """Copies a state to CPU buffers reused across saves; DCP's ``AsyncStager`` protocol, so that
    ``dcp.async_save(async_stager=...)`` takes it too (its ``stage`` returns a finished copy)."""

    _synchronize_after_execute = False

    def __init__(self, num_threads: int = 1, shared_memory: bool = False) -> None:
        self.num_threads = max(1, num_threads)
        self.shared_memory = shared_memory
        """Buffers in shared memory, for a writer process that reads them without another copy."""
        self.cuda = torch.cuda.is_available()
        self._buffers: WeakIdKeyDictionary = WeakIdKeyDictionary()  # source storage -> CPU storage
        self._pool: ThreadPoolExecutor | None = None
        self._fallback: DefaultStager | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is complete."""

    @torch.no_grad()
    def stage(self, state: Any) -> Any:
        """A copy of ``state`` that later changes to ``state`` do not reach, its tensors on the CPU."""
        copies: list[_Pair] = []
        try:
            staged = self._rebuild(state, copies, {})
        except _Unsupported:
            return self._dcp_stager().stage(state)
        self._copy(copies)
        return staged

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None
        self._buffers.clear()

    # ---------------------------------------------------------------------------------------- structure

    def _rebuild(self, value: Any, copies: list[Any], memo: dict[int, torch.UntypedStorage]) -> Any:
        """``value`` with each tensor replaced by one over its storage's CPU buffer; the storages to
        copy added to ``copies`` (each once: ``memo`` maps a source storage's id to its buffer)."""
        if isinstance(value, torch.Tensor):
            return self._tensor(value, copies, memo)
        if isinstance(value, dict):
            rebuilt = copy.copy(value)  # the same type, its attributes (a state_dict's _metadata) too
            for key, item in value.items():
                rebuilt[key] = self._rebuild(item, copies, memo)
            if getattr(value, "__dict__", None):
                rebuilt.__dict__.update(copy.deepcopy(value.__dict__))
            return rebuilt
        if type(value) is list:
            return [self._rebuild(item, copies, memo) for item in value]
        if type(value) is tuple:
            return tuple(self._rebuild(item, copies, memo) for item in value)
        if isinstance(value, _ATOMIC):
            return value
        raise _Unsupported(type(value).__name__)

    def _tensor(
        self, tensor: torch.Tensor, copies: list[Any], memo: dict[int, torch.UntypedStorage]
    ) -> torch.Tensor:
        if (
            type(tensor) is not torch.Tensor
            or tensor.layout != torch.strided
            or tensor.is_quantized
            or tensor.is_conj()
            or tensor.is_neg()
            or tensor.device.type == "meta"
        ):
            raise _Unsupported(f"{type(tensor).__name__} {tensor.layout}")
        source = tensor.untyped_storage()
        buffer = memo.get(id(source))
        if buffer is None:
            buffer = self._buffer_for(source)
            memo[id(source)] = buffer
            copies.append((buffer, source))
        staged = torch.empty(0, dtype=tensor.dtype)
        return staged.set_(buffer, tensor.storage_offset(), tensor.size(), tensor.stride())

    def _buffer_for(self, source: torch.UntypedStorage) -> torch.UntypedStorage:
        """The CPU buffer of ``source``: the one of the last save while that storage lives."""
        buffer: torch.UntypedStorage | None = self._buffers.get(source)  # type: ignore[no-untyped-call]
        if buffer is not None and buffer.nbytes() == source.nbytes():
            return buffer
        if self.shared_memory:
            buffer = torch.UntypedStorage._new_shared(source.nbytes())  # type: ignore[no-untyped-call]
        elif self.cuda:
            buffer = torch.empty(source.nbytes(), dtype=torch.uint8, pin_memory=True).untyped_storage()
        else:
            buffer = torch.empty(source.nbytes(), dtype=torch.uint8).untyped_storage()
        self._buffers[source] = buffer
        return buffer

    # ---------------------------------------------------------------------------------------- copy

    def _copy(self, copies: list[_Pair]) -> None:
        """Copy every source storage into its buffer, in up to ``num_threads`` threads of about
        equal bytes; with CUDA, non-blocking device-to-host copies waited for before returning."""
        total = sum(source.nbytes() for _, source in copies)
        threads = min(self.num_threads, max(1, total // MIN_BYTES_PER_THREAD))
        non_blocking = self.cuda and any(source.device.type == "cuda" for _, source in copies)
        if threads == 1:
            for buffer, source in copies:
                buffer.copy_(source, non_blocking=non_blocking)
        else:
            chunks = _byte_chunks(copies, threads)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_threads - 1, thread_name_prefix="tunepod-stage")
            started = [self._pool.submit(_copy_chunk, chunk, non_blocking) for chunk in chunks[1:]]
            _copy_chunk(chunks[0], non_blocking)
            for future in started:
                future.result()
        if non_blocking:
            torch.cuda.synchronize()  # the training loop may change the state once save returns

    def _dcp_stager(self) -> DefaultStager:
        if self._fallback is None:
            self._fallback = DefaultStager(
                StagingOptions(
                    use_pinned_memory=self.cuda,
                    use_shared_memory=self.shared_memory,
                    use_async_staging=False,  # the training loop may change the state once save returns
                    use_non_blocking_copy=self.cuda,
                )
            )
        return self._fallback


_Piece = tuple[torch.Tensor, torch.Tensor]  # (destination, source) byte views


def _byte_chunks(copies: list[_Pair], count: int) -> list[list[_Piece]]:
    """The copies cut into ``count`` lists of byte ranges of about equal size (a storage larger than
    a share is split across lists)."""
    total = sum(source.nbytes() for _, source in copies)
    share = -(-total // count) if total else 1
    chunks: list[list[_Piece]] = [[]]
    room = share
    for buffer, source in copies:
        destination = _bytes(buffer)
        origin = _bytes(source)
        start, size = 0, source.nbytes()
        while start < size:
            if room == 0:
                chunks.append([])
                room = share
            end = min(size, start + room)
            chunks[-1].append((destination[start:end], origin[start:end]))
            room -= end - start
            start = end
    return chunks


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _copy_chunk(pieces: list[_Piece], non_blocking: bool) -> None:
    for destination, source in pieces:
        destination.copy_(source, non_blocking=non_blocking)
