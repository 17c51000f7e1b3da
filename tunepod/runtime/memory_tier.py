"""The memory tier: checkpoints in each node's memory, copied to peer nodes, restored from wherever
the newest complete step is.

Used by ``TrainingContext`` when the job has checkpoint tiers (``TUNEPOD_CHECKPOINT_TIERS``). Every
method is a collective: call it on every rank alike (the first one sets the tier up: a gloo group of
its own, an HTTP server per rank serving its node's job folder, the attempt's nonce and token from
rank 0, and every rank's node and address).

A save copies the state to reusable CPU buffers on the training thread and returns; a background
thread writes it into this node's step folder, then the writer's manifest, then pushes the files and
the manifest to the same local rank on the next ``memory_replicas`` nodes, and (local rank 0) prunes
the node's older steps. One save in flight: the next save, ``wait`` and ``finish`` wait for it.
Whole-state saves are written by rank 0 in the shared step format (``state.pt``, ``metadata.json``);
sharded ones by every rank with DCP into its node's step folder (rank 0 adds DCP's ``.metadata``).

A restore lists every node's job folder, picks the newest step complete somewhere
(``memory_store.choose_restore``; the shared folder's newest valid step when it is newer), and each
rank reads what it needs from its own node, else from a holder over HTTP, checksums verified, with
the same safe loaders as the shared folder. ``finish`` copies the newest memory step to the shared
folder when it is newer than the newest shared one, then removes the job's memory folders.

torch is imported here: import this module only when a checkpoint is saved or loaded.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse, async_save
from torch.futures import Future as TorchFuture

from tunepod.runtime import checkpoints
from tunepod.runtime.checkpoints import METADATA_FILE, STATE_FILE, Checkpoint
from tunepod.runtime.files import disk_full_explained, sha256_of
from tunepod.runtime.memory_store import (
    FileEntry,
    Manifest,
    RestorePlan,
    begin_writing,
    choose_restore,
    job_folder,
    list_job_folder,
    manifest_name,
    prune_job_folder,
    remove_folder,
    step_folder,
    write_manifest,
)
from tunepod.runtime.peer_http import PeerError, PeerServer, delete_manifest, fetch_file, push_file
from tunepod.runtime.restores import OWN_MEMORY, PEER_MEMORY, SHARED_FILE_SYSTEM, Tier
from tunepod.runtime.sharded import SafeReader, ShardedCheckpointer, refuse_unloadable_values, reusable_stager
from tunepod.runtime.tiers import CheckpointTiers, SaveTargets, TierSchedule

T = TypeVar("T")
DCP_METADATA = ".metadata"
_WHOLE_STATE_FILES = [STATE_FILE, METADATA_FILE]  # metadata.json last, as a step is written


@dataclass(frozen=True)
class RestoredFrom:
    """Where this rank's restored step came from: its node's memory, a peer node's memory (``peer``:
    the address it was fetched from) or the shared file system."""

    step: int
    tier: Tier
    peer: str | None = None

    def __str__(self) -> str:
        return f"{PEER_MEMORY} ({self.peer})" if self.peer else self.tier


@dataclass(frozen=True)
class _Member:
    """What each rank tells the others when the tier is set up."""

    rank: int
    node: int
    local_rank: int
    address: str


class MemoryTier:
    """The memory tier of one process; used from the thread that runs the training loop."""

    def __init__(
        self,
        tiers: CheckpointTiers,
        checkpoint_dir: Path,
        keep: int,
        rank: int,
        world_size: int,
        env: Mapping[str, str],
    ) -> None:
        self.tiers = tiers
        self.checkpoint_dir = checkpoint_dir
        self.keep = keep
        self.rank = rank
        self.world_size = world_size
        self.job = job_folder(tiers.memory_dir, checkpoint_dir)
        self.schedule = TierSchedule(tiers)
        self._env = env
        self._ready = False
        self._group: dist.ProcessGroup | None = None
        self._members: list[_Member] = []
        self.nonce = ""
        self._token = ""
        self._server: PeerServer | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tunepod-memory-save")
        self._pending: Future[None] | None = None
        self._stager = reusable_stager()
        self._last_sharded = False
        self._own_files: dict[str, FileEntry] = {}
        """The files this rank wrote for its last memory save."""
        self._restored: RestorePlan | None = None
        self.restored_sources: list[str] = []
        """Where each rank's files of the last restore came from, in rank order (every rank)."""

    # ------------------------------------------------------------------------------------------ save

    def targets(self, step: int, stopping: bool) -> SaveTargets:
        return self.schedule.targets(step, stopping)

    def save(self, state: Any, step: int, sharded: bool) -> Path | None:
        """Start the memory save of ``state`` as ``step`` and return its folder on this node (``None``
        on the ranks that write nothing: every rank but 0 for a whole-state save)."""
        self.set_up()
        self.wait()
        folder = step_folder(self.job, step)
        self._last_sharded = sharded
        if sharded:
            return self._save_sharded(state, step, folder)
        if self.rank != 0:
            return None
        if isinstance(state, Mapping):
            refuse_unloadable_values(state)  # here, on the training thread, not in the background
        staged = state if isinstance(state, bytes | bytearray) else self._stager.stage(state)
        self._pending = self._executor.submit(self._write_whole_state, staged, step, folder)
        return folder

    def _save_sharded(self, state: dict[str, Any], step: int, folder: Path) -> Path:
        own = [p.name for p in folder.glob(f"__{self.rank}_*")] + ([DCP_METADATA] if self.rank == 0 else [])

        def prepare() -> None:
            refuse_unloadable_values(state)
            begin_writing(folder, self.rank, own)

        self._on_every_rank("save this state to memory", prepare)
        response = async_save(
            state,
            storage_writer=FileSystemWriter(folder, sync_files=False),  # memory: nothing to sync to
            process_group=self._group,
            no_dist=self._group is None,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            async_stager=self._stager,
        )
        written = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        self._pending = self._executor.submit(self._after_dcp_write, written, step, folder)
        return folder

    def wait(self) -> None:
        """Wait for the memory save in flight, if any; raise what it raised (on this rank)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def saved(self, step: int, targets: SaveTargets) -> None:
        self.schedule.saved(step, targets)
        if targets.memory:
            self._restored = None  # the newest memory step is now one this attempt wrote

    def _write_whole_state(self, staged: Any, step: int, folder: Path) -> None:
        """Background, rank 0: the step in the shared format, through a hidden folder, then the
        manifest, then the peers."""
        with self._memory_full_explained(folder):
            begin_writing(folder, self.rank, _WHOLE_STATE_FILES)
            hidden = self.job / f".~{folder.name}-{secrets.token_hex(4)}"
            hidden.mkdir()
            try:
                state_format = checkpoints.write_step_files(hidden, staged, step)
                for name in _WHOLE_STATE_FILES:
                    os.replace(hidden / name, folder / name)
            finally:
                shutil.rmtree(hidden, ignore_errors=True)
            self._commit(folder, step, state_format, (0,), _WHOLE_STATE_FILES)

    def _after_dcp_write(self, written: Future[Any] | TorchFuture[Any], step: int, folder: Path) -> None:
        """Background, every rank: once DCP wrote every rank's shard, this rank's manifest and push."""
        written.wait() if isinstance(written, TorchFuture) else written.result()
        own = sorted(p.name for p in folder.glob(f"__{self.rank}_*.distcp"))
        own += [DCP_METADATA] if self.rank == 0 else []
        with self._memory_full_explained(folder):
            self._commit(folder, step, checkpoints.DCP_FORMAT, tuple(range(self.world_size)), own)

    def _commit(
        self, folder: Path, step: int, state_format: str, writers: tuple[int, ...], names: list[str]
    ) -> None:
        files = {name: FileEntry(sha256_of(folder / name), (folder / name).stat().st_size) for name in names}
        manifest = Manifest(step, self.rank, writers, state_format, self.nonce, time.time(), files)
        write_manifest(folder, manifest)
        self._own_files = files
        self._push(folder, manifest)
        if self._local_rank() == 0:
            prune_job_folder(self.job, self.nonce)

    def _push(self, folder: Path, manifest: Manifest) -> None:
        """Copy this writer's files, then its manifest, to each replica. A peer that fails is named on
        stderr: the step is complete on this node all the same, and the next save tries again."""
        for address in self._replica_addresses():
            try:
                delete_manifest(address, self._token, folder.name, manifest.writer)
                for name in manifest.files:
                    push_file(address, self._token, folder.name, folder / name)
                push_file(address, self._token, folder.name, folder / manifest_name(manifest.writer))
            except (OSError, PeerError) as exc:
                _log(
                    f"could not copy memory step {manifest.step} to peer {address} ({exc}); that peer "
                    "has no copy of it"
                )

    def _memory_full_explained(self, folder: Path) -> contextlib.AbstractContextManager[None]:
        return disk_full_explained(
            folder,
            f"give checkpoints.memory_dir ({self.tiers.memory_dir}) more room (a larger /dev/shm: "
            "docker --shm-size, a Kubernetes emptyDir with medium Memory and a sizeLimit), or set "
            "memory_replicas lower; the shared checkpoints are not affected",
        )

    # ------------------------------------------------------------------------------------------ restore

    def restore(
        self, into: dict[str, Any] | None, sharded: Callable[[], ShardedCheckpointer]
    ) -> tuple[Checkpoint | None, RestoredFrom | None]:
        """The newest step complete in some live node's memory, or the shared folder's when newer;
        ``(None, None)`` for a fresh start. ``into`` as ``TrainingContext.load_latest_checkpoint``."""
        self.set_up()
        self.wait()
        shared = self._on_rank0("pick the newest shared checkpoint", self._newest_shared)
        listings = self._all_gather((self._node(), list_job_folder(self.job), shared))
        nodes = {node: listing for node, listing, _ in listings}
        plan = choose_restore(nodes, listings[0][2])
        if plan is None:
            return None, None
        restored = self._on_every_rank(f"restore step {plan.step}", lambda: self._load(plan, into, sharded))
        assert restored is not None  # _on_every_rank raised otherwise
        loaded, source = restored
        sources = self.restored_sources = self._all_gather(str(source))
        if self.rank == 0:
            where = (
                sources[0]
                if len(set(sources)) == 1
                else ", ".join(f"rank {r} {s}" for r, s in enumerate(sources))
            )
            _log(f"restored step {plan.step} from {where}")
        self.schedule.restored(plan.step, plan.newest_shared)
        self._restored = plan if plan.tier == "memory" else None
        self._last_sharded = plan.format == checkpoints.DCP_FORMAT
        return loaded, source

    def _newest_shared(self) -> int | None:
        info = checkpoints.newest_valid_checkpoint(self.checkpoint_dir)
        return None if info is None else info.step

    def _load(
        self, plan: RestorePlan, into: dict[str, Any] | None, sharded: Callable[[], ShardedCheckpointer]
    ) -> tuple[Checkpoint, RestoredFrom]:
        if plan.tier == "shared":
            source = RestoredFrom(plan.step, SHARED_FILE_SYSTEM)
            if into is not None:
                return sharded().load_step(into, plan.step), source
            info = checkpoints.verified_checkpoint(self.checkpoint_dir, plan.step)
            if info is None or info.step != plan.step:
                raise RuntimeError(f"shared step {plan.step} under {self.checkpoint_dir} is gone or damaged")
            return Checkpoint(plan.step, checkpoints.read_whole_state(info), info.path), source
        files = _StepFiles(self, plan)
        folder = files.folder
        if plan.format != checkpoints.DCP_FORMAT:
            for name in _WHOLE_STATE_FILES:
                files.ensure(name)
            info = checkpoints.saved_checkpoint(folder)  # each file's sha256 checked by ensure
            if info is None:
                raise RuntimeError(
                    f"memory step {folder} is not a complete step after its files were fetched"
                )
            state = checkpoints.read_whole_state(info)
        elif into is None:
            for name in plan.files:
                files.ensure(name)
            from tunepod.runtime.sharded import read_whole_state

            state = read_whole_state(folder, _FetchingReader(folder, files))
        else:
            sharded().load_into(into, _FetchingReader(folder, files))
            state = into
        return Checkpoint(plan.step, state, folder), files.source()

    # ------------------------------------------------------------------------------------------ finish

    def finish(self) -> Path | None:
        """Copy the newest memory step to the shared folder when it is newer than the newest shared
        one (returns that folder), then remove the job's memory folder on every node."""
        if not self._ready:
            return None
        self.wait()
        step, shared = self.schedule.last_memory, self.schedule.last_shared
        flushed = None
        if step is not None and (shared is None or step > shared):
            flushed = self._flush(step)
            self.schedule.saved(step, SaveTargets(shared=True, memory=False))
        self._on_every_rank("finish the memory tier", lambda: None)  # every rank is done with the peers
        self.close()
        if self._local_rank() == 0:
            remove_folder(self.job)
        return flushed

    def _flush(self, step: int) -> Path:
        folder = step_folder(self.job, step)
        files = _StepFiles(self, self._restored) if self._restored is not None else None
        if not self._last_sharded:

            def copy_whole() -> Path | None:
                if self.rank != 0:
                    return None
                for name in _WHOLE_STATE_FILES:
                    if files is not None:
                        files.ensure(name)
                return checkpoints.commit_copied_step(
                    self.checkpoint_dir, folder, step, self.keep, _WHOLE_STATE_FILES
                )

            self._on_every_rank(f"copy memory step {step} to the shared folder", copy_whole)
            return self.checkpoint_dir / checkpoints.step_folder_name(step)
        self._on_rank0(
            "prepare the shared folder",
            lambda: checkpoints.prepare_sharded_save(self.checkpoint_dir, step, self.keep),
        )
        hidden = checkpoints.sharded_temp_folder(self.checkpoint_dir, step)

        def copy_own() -> None:
            for name in self._names_to_flush():
                if files is not None:
                    files.ensure(name)
                shutil.copyfile(folder / name, hidden / name)

        started = time.monotonic()
        self._on_every_rank(f"copy memory step {step} to the shared folder", copy_own)

        def commit() -> Path:
            listed = checkpoints.hash_step_files(hidden)
            return checkpoints.commit_sharded_save(
                self.checkpoint_dir, step, self.keep, listed, time.monotonic() - started
            )

        self._on_rank0(f"commit step {step}", commit)
        return self.checkpoint_dir / checkpoints.step_folder_name(step)

    def _names_to_flush(self) -> list[str]:
        """This rank's share of the step's files: its own, or of a restored step the files of the
        writers ``w`` with ``w % world_size == rank`` (the world may have changed since)."""
        if self._restored is None:
            return list(self._own_files)
        plan = self._restored
        return [
            name
            for writer in plan.holders
            if writer % self.world_size == self.rank
            for name in plan.files_of(writer)
        ]

    def close(self) -> None:
        """Stop serving peers and the background thread (after the save in flight)."""
        with contextlib.suppress(BaseException):
            self.wait()
        if self._server is not None:
            self._server.close()
            self._server = None
        self._executor.shutdown(wait=True)
        self._ready = False

    # ------------------------------------------------------------------------------------------ set up

    def set_up(self) -> None:
        """Once per process, on every rank: the group, the nonce and token, the server, the members."""
        if self._ready:
            return
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self.world_size > 1 and not distributed:
            raise RuntimeError(
                f"checkpoint tiers in a job of {self.world_size} processes need torch.distributed: fix: "
                "call torch.distributed.init_process_group() on every rank before loading or saving"
            )
        self._group = dist.new_group(backend="gloo") if distributed else None
        self.job.mkdir(parents=True, exist_ok=True)
        self.nonce, self._token = self._broadcast((secrets.token_hex(8), secrets.token_hex(16)))
        prune = (lambda: prune_job_folder(self.job, self.nonce)) if self._local_rank() == 0 else None
        self._server = PeerServer(self.job, _reachable_host(self._env), self._token, on_manifest=prune)
        node_id = _node_id(self._env, self.rank)
        gathered = self._all_gather((node_id, self._local_rank(), self._server.address))
        node_ids = sorted({node for node, _, _ in gathered})
        self._members = [
            _Member(rank, node_ids.index(node), local, address)
            for rank, (node, local, address) in enumerate(gathered)
        ]
        self._ready = True
        replicas = self.tiers.memory_replicas
        if self.rank == 0 and replicas > len(node_ids) - 1:
            _log(
                f"checkpoints.memory_replicas is {replicas} but the job has {len(node_ids)} node(s): memory "
                f"saves get {len(node_ids) - 1} peer copies (a peer is another node)"
            )

    def _node(self) -> int:
        return self._members[self.rank].node if self._members else 0

    def _local_rank(self) -> int:
        return int(self._env.get("LOCAL_RANK", "0") or 0)

    def _replica_addresses(self) -> list[str]:
        """The same local rank (else the node's first rank) on each of the next ``memory_replicas`` nodes."""
        me = self._members[self.rank]
        nodes = 1 + max(m.node for m in self._members)
        addresses = []
        for k in range(1, min(self.tiers.memory_replicas, nodes - 1) + 1):
            on_node = [m for m in self._members if m.node == (me.node + k) % nodes]
            same = [m for m in on_node if m.local_rank == me.local_rank]
            addresses.append((same or on_node)[0].address)
        return addresses

    def address_on(self, node: int) -> str:
        """A server on ``node``: the one of this rank's local rank if there is one."""
        on_node = [m for m in self._members if m.node == node]
        same = [m for m in on_node if m.local_rank == self._local_rank()]
        return (same or on_node)[0].address

    # ------------------------------------------------------------------------------------------ collectives

    def _broadcast(self, value: T) -> T:
        if self._group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def _all_gather(self, value: T) -> list[T]:
        if self._group is None:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self._group)
        return gathered

    def _on_rank0(self, what: str, action: Callable[[], T]) -> T | None:
        return self._on_every_rank(what, action, self.rank == 0)

    def _on_every_rank(self, what: str, action: Callable[[], T], runs_here: bool = True) -> T | None:
        """Run ``action`` (where ``runs_here``) and agree whether it worked on every rank: a failing
        rank raises its own error, the others one that points at its log, so none goes on alone."""
        result: T | None = None
        error: BaseException | None = None
        if runs_here:
            try:
                result = action()
            except BaseException as exc:  # raised below, once the other ranks know
                error = exc
        if self._group is not None:
            failed = torch.tensor([0 if error is None else 1], dtype=torch.int32)
            try:
                dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self._group)
            except Exception as broken:
                # The group broke (a peer's node died): this rank's own failure, if it had one (a
                # fetch from that node), says more than the collective's lost connection.
                if error is not None:
                    raise error from broken
                raise
            if error is None and failed.item():
                raise RuntimeError(
                    f"another rank could not {what} (memory tier under {self.job}); see its log"
                )
        if error is not None:
            raise error
        return result


class _StepFiles:
    """The files of a restored memory step in this node's step folder: each one read from here when
    this node holds its writer's files, else fetched from a node that does; every one checked
    against its manifest's sha256 before use."""

    def __init__(self, tier: MemoryTier, plan: RestorePlan) -> None:
        self._tier = tier
        self._plan = plan
        self.folder = step_folder(tier.job, plan.step)
        self._ready: set[str] = set()
        self._peers: list[str] = []

    def ensure(self, name: str) -> None:
        if name in self._ready:
            return
        entry, writer = self._plan.files[name], self._plan.writer_of[name]
        holders = self._plan.holders[writer]
        here = self._tier._node()
        if here in holders and sha256_of(self.folder / name) == entry.sha256:
            self._ready.add(name)
            return
        self._forget_stale_manifest(writer)
        errors = []
        for node in [n for n in holders if n != here]:
            address = self._tier.address_on(node)
            try:
                fetch_file(
                    address, self._tier._token, self.folder.name, self.folder / name, entry.sha256, entry.size
                )
            except (OSError, PeerError) as exc:
                errors.append(f"{address}: {exc}")
                continue
            self._peers.append(address)
            self._ready.add(name)
            return
        raise PeerError(
            f"no node could give {self.folder.name}/{name} of this attempt: "
            f"{'; '.join(errors) or 'no holder'}"
        )

    def _forget_stale_manifest(self, writer: int) -> None:
        """A fetched file replaces this node's copy: a manifest of another attempt must not list it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / manifest_name(writer)
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            if Manifest.from_bytes(path.read_bytes()).nonce != self._plan.nonce:
                path.unlink()

    def source(self) -> RestoredFrom:
        if self._peers:
            return RestoredFrom(self._plan.step, PEER_MEMORY, self._peers[0])
        return RestoredFrom(self._plan.step, OWN_MEMORY)


class _FetchingReader(SafeReader):
    """The safe DCP reader over a memory step folder, fetching each file from a peer on first use."""

    def __init__(self, folder: Path, files: _StepFiles) -> None:
        super().__init__(folder)
        self._files = files

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        self._files.ensure(DCP_METADATA)
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        for item in plan.items:
            self._files.ensure(self.storage_data[item.storage_index].relative_path)
        return super().read_data(plan, planner)


def _reachable_host(env: Mapping[str, str]) -> str:
    """The local address peers reach this node at: the one of a socket towards the rendezvous host
    (``MASTER_ADDR``); loopback for a job on one machine without it."""
    master = env.get("MASTER_ADDR")
    if not master:
        return "127.0.0.1"
    family, kind, _, _, target = socket.getaddrinfo(
        master, int(env.get("MASTER_PORT", "1") or 1), type=socket.SOCK_DGRAM
    )[0]
    with socket.socket(family, kind) as probe:
        probe.connect(target)  # UDP: picks the route and the local address, sends nothing
        return str(probe.getsockname()[0])


def _node_id(env: Mapping[str, str], rank: int) -> int:
    """This rank's node: torchrun's ``GROUP_RANK``, else Slurm's ``SLURM_NODEID``, else its rank
    divided by the processes per node."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if env.get(name, "").strip():
            return int(env[name])
    return rank // max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))


def _log(message: str) -> None:
    print(f"tunepod.runtime: {message}", file=sys.stderr, flush=True)
