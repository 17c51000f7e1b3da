"""The memory tier as a job's rank 0 runs it on the simulated nodes, and the ground truth of it.

With checkpoint tiers (``TUNEPOD_CHECKPOINT_TIERS``) the program decides each save's tiers with the
runtime's own ``TierSchedule``. A memory save writes the step into its node's memory folder
(``<root>/shm/<node>``, standing in for ``/dev/shm``) in the memory tier's layout
(``tunepod.runtime.memory_store``: the state files, then rank 0's manifest, then a prune of the older
steps), and then, after a pause (the background copy), the same into the next node of its group (the
peer replica, which that node prunes as its peer server does). A shared save is ``save_checkpoint``,
as without tiers. A restore lists the memory folders of the nodes of the group that answer and takes
the step the real ``memory_store.choose_restore`` picks, reading it from a node that holds it, and
rank 0 records it in the restores file (which the orchestrator mirrors into MLflow). ``ctx.finish``
copies the newest memory step to the shared folder when it is newer, then removes the memory
folders; so does the batch script's trap (without the copy) when the script ends by itself; a node
that stopped answering comes back rebooted, its memory gone.

``MemoryTruth`` is what the referee reads: per node and job dir, the newest step complete there (its
manifest written), kept apart from the files and from the real code that reads them, so that a
restore that picks another step is seen. Only whole-state steps of one writer (rank 0) are simulated:
the choice of a step, not DCP's shards, is what the orchestrator's view depends on.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from simulation.scheduler import Scheduler
from tunepod.runtime import checkpoints, memory_store
from tunepod.runtime.files import append_line_durably, sha256_of
from tunepod.runtime.memory_store import FileEntry, Manifest
from tunepod.runtime.restores import OWN_MEMORY, PEER_MEMORY, SHARED_FILE_SYSTEM, Restore, job_tier
from tunepod.runtime.tiers import CheckpointTiers, SaveTargets, TierSchedule

_STATE_FILES = (checkpoints.STATE_FILE, checkpoints.METADATA_FILE)  # metadata.json last, as a step is written


@dataclass
class MemoryTruth:
    """Per node and job dir, the newest memory step complete there (see the module docstring), and
    the nodes whose memory is out of reach (they do not answer)."""

    root: Path
    newest: dict[tuple[str, Path], int] = field(default_factory=dict)
    silent: set[str] = field(default_factory=set)

    def job_folder(self, node: str, checkpoint_dir: Path) -> Path:
        return memory_store.job_folder(self.root / node, checkpoint_dir)

    def holds(self, node: str, job_dir: Path, step: int) -> None:
        self.newest[(node, job_dir)] = max(step, self.newest.get((node, job_dir), step))

    def reachable(self, nodes: Sequence[str]) -> list[str]:
        """The nodes of a group (rank order) whose memory rank 0 can read: its own (the first), and
        the others that answer."""
        return [node for index, node in enumerate(nodes) if index == 0 or node not in self.silent]

    def newest_on(self, nodes: Sequence[str], job_dir: Path) -> int | None:
        """The newest step complete in the memory rank 0 of a group on ``nodes`` can read."""
        held = [
            self.newest[(node, job_dir)] for node in self.reachable(nodes) if (node, job_dir) in self.newest
        ]
        return max(held, default=None)

    def forget(self, node: str, job_dir: Path, checkpoint_dir: Path) -> None:
        """The job's memory folder on ``node`` is removed (``ctx.finish``, the batch script's trap)."""
        shutil.rmtree(self.job_folder(node, checkpoint_dir), ignore_errors=True)
        self.newest.pop((node, job_dir), None)

    def wipe(self, node: str) -> None:
        """``node`` rebooted: its memory is empty."""
        shutil.rmtree(self.root / node, ignore_errors=True)
        for key in [key for key in self.newest if key[0] == node]:
            del self.newest[key]


@dataclass(frozen=True)
class Restored:
    step: int
    state: bytes
    tier: str


class RankZeroMemory:
    """One program's memory tier (its rank 0's side): the schedule, the saves, the restores."""

    def __init__(
        self,
        sim: Scheduler,
        truth: MemoryTruth,
        tiers: CheckpointTiers,
        job_dir: Path,
        checkpoint_dir: Path,
        group: Callable[[], list[str]],
        nonce: str,
    ) -> None:
        self.sim = sim
        self.truth = truth
        self.schedule = TierSchedule(tiers)
        self.job_dir = job_dir
        self.checkpoint_dir = checkpoint_dir
        self.group = group
        """The nodes of the job's group, rank order (rank 0's first), that still train together."""
        self.nonce = nonce

    def restore(self, restores_file: Path, wall_now: float) -> Restored | None:
        """The step the real ``choose_restore`` picks over the group's nodes that answer, read from a
        node that holds it (or the shared folder), recorded in the restores file as rank 0 does."""
        nodes = self.group()
        reachable = self.truth.reachable(nodes)
        listings = {
            index: memory_store.list_job_folder(self.truth.job_folder(node, self.checkpoint_dir))
            for index, node in enumerate(nodes)
            if node in reachable
        }
        shared = checkpoints.newest_valid_checkpoint(self.checkpoint_dir)
        plan = memory_store.choose_restore(listings, None if shared is None else shared.step)
        if plan is None:
            return None
        source: str = SHARED_FILE_SYSTEM
        if plan.tier == "shared":
            info = checkpoints.verified_checkpoint(self.checkpoint_dir, plan.step)
        else:
            holder = min(plan.holders[0])
            folder = memory_store.step_folder(
                self.truth.job_folder(nodes[holder], self.checkpoint_dir), plan.step
            )
            info = checkpoints.saved_checkpoint(folder)
            source = OWN_MEMORY if holder == 0 else f"{PEER_MEMORY} ({nodes[holder]})"
        assert info is not None and info.step == plan.step, f"restore plan {plan} has no readable step"
        restore = Restore(plan.step, job_tier([source]), (source,), wall_now)
        append_line_durably(restores_file, restore.to_json())
        self.schedule.restored(plan.step, plan.newest_shared)
        return Restored(plan.step, checkpoints.read_whole_state(info), restore.tier)

    def targets(self, step: int, *, stopping: bool = False) -> SaveTargets:
        return self.schedule.targets(step, stopping)

    def save_to_memory(self, state: bytes, step: int, copy_s: float) -> None:
        """The step into this node's memory (complete once its manifest is written), then, ``copy_s``
        later, into the next node's of the group that answers (the replica)."""
        nodes = self.group()
        own = self.truth.job_folder(nodes[0], self.checkpoint_dir)
        manifest = self._write(own, state, step)
        self.truth.holds(nodes[0], self.job_dir, step)
        memory_store.prune_job_folder(own, self.nonce)
        self.sim.sleep(copy_s)
        peers = [node for node in self.group()[1:] if node not in self.truth.silent]
        if not peers:
            return  # the peer was lost meanwhile (or the job runs on one node): no replica
        replica = self.truth.job_folder(peers[0], self.checkpoint_dir)
        folder = memory_store.step_folder(replica, step)
        memory_store.begin_writing(folder, 0, list(_STATE_FILES))
        for name in _STATE_FILES:
            memory_store.write_file(folder / name, (memory_store.step_folder(own, step) / name).read_bytes())
        memory_store.write_manifest(folder, manifest)
        self.truth.holds(peers[0], self.job_dir, step)
        memory_store.prune_job_folder(replica, self.nonce)  # the peer server's local rank 0 prunes

    def saved(self, step: int, targets: SaveTargets) -> None:
        self.schedule.saved(step, targets)

    def newest_unshared(self) -> int | None:
        """The newest memory step when it is newer than the newest shared one (``finish`` flushes it)."""
        memory, shared = self.schedule.last_memory, self.schedule.last_shared
        return memory if memory is not None and (shared is None or memory > shared) else None

    def memory_state(self, step: int) -> bytes | None:
        """The state of memory step ``step`` from the first node of the group that holds it (a step
        restored from a peer may be on that peer alone); None when none that rank 0 reaches does."""
        for node in self.truth.reachable(self.group()):
            folder = memory_store.step_folder(self.truth.job_folder(node, self.checkpoint_dir), step)
            info = checkpoints.saved_checkpoint(folder)
            if info is not None:
                state = checkpoints.read_whole_state(info)
                assert isinstance(state, bytes)
                return state
        return None

    def forget(self) -> None:
        """Remove the job's memory folders on the group's nodes that answer."""
        for node in self.truth.reachable(self.group()):
            self.truth.forget(node, self.job_dir, self.checkpoint_dir)

    def _write(self, job: Path, state: bytes, step: int) -> Manifest:
        folder = memory_store.step_folder(job, step)
        memory_store.begin_writing(folder, 0, list(_STATE_FILES))
        state_format = checkpoints.write_step_files(folder, state, step)
        files = {
            name: FileEntry(sha256_of(folder / name), (folder / name).stat().st_size) for name in _STATE_FILES
        }
        manifest = Manifest(step, 0, (0,), state_format, self.nonce, self.sim.now, files)
        memory_store.write_manifest(folder, manifest)
        return manifest
