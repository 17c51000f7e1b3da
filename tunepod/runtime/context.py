"""``TrainingContext``: what a training script holds to read its job and report back.

One context per process, used from the thread that runs the training loop. Writes follow one rule:
rank 0 writes (metrics file, checkpoints, result file), every other rank only reads, so the scripts
can call every method on every rank without ``if rank == 0`` around them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tunepod.runtime import checkpoints, metrics, restores, worlds
from tunepod.runtime.contract import Contract, Source, read_contract
from tunepod.runtime.parallel import Parallelism, device_mesh
from tunepod.runtime.progress import (
    Heartbeat,
    forget_ranks_from,
    heartbeat_interval_s,
    progress_dir,
    progress_log_s,
)
from tunepod.runtime.stopping import StopRequest
from tunepod.runtime.tiers import CheckpointTiers

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from tunepod.runtime.memory_tier import MemoryTier, RestoredFrom
    from tunepod.runtime.sharded import ShardedCheckpointer


class TrainingContext:
    """The job's parameters, folders and distributed identity, and the methods that report back.

    Built by ``init()``; attributes are plain values, set once.
    """

    def __init__(
        self,
        contract: Contract,
        heartbeat: Heartbeat | None = None,
        stop: StopRequest | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.source: Source = contract.source
        self.params: dict[str, Any] = dict(contract.params)
        self.data_dir: Path = contract.data_dir
        self.checkpoint_dir: Path = contract.checkpoint_dir
        self.metrics_file: Path = contract.metrics_file
        self.result_file: Path = contract.result_file
        self.trial: str | None = contract.trial
        self.keep_checkpoints: int = contract.keep_checkpoints
        self.rank: int = contract.rank
        self.local_rank: int = contract.local_rank
        self.world_size: int = contract.world_size
        self.parallelism: Parallelism = contract.parallelism
        self.mlflow_tracking_uri: str | None = contract.mlflow_tracking_uri
        self.mlflow_run_id: str | None = contract.mlflow_run_id
        self._last_reported_step: int | None = None
        self._heartbeat = heartbeat
        self._stop = stop or StopRequest()
        self.checkpoint_tiers: CheckpointTiers | None = contract.checkpoint_tiers
        self.restored_from: RestoredFrom | None = None
        """Where ``load_latest_checkpoint`` found the step, with checkpoint tiers: ``own memory``,
        ``peer memory (<address>)`` or ``shared file system``; ``None`` before, without tiers, or on a
        fresh start."""
        self.world_change: worlds.WorldChange | None = None
        """Set by ``load_latest_checkpoint`` on every rank when the job's group is not the one that
        last ran it: an elastic job re-formed with fewer nodes after a node loss, or a job that came
        back on another number of them. It says the world size and node count before and now, and the
        restored step the new world trains from, so the script can rescale its batch or learning
        rate. ``None`` on a fresh start, in an unchanged world, and before the call."""
        self._world_noted = False
        self._sharded: ShardedCheckpointer | None = None
        self._memory: MemoryTier | None = None
        self._stop_agreed = False
        self._env = dict(env) if env is not None else {}

    @property
    def world_size_changed(self) -> bool:
        """Whether ``load_latest_checkpoint`` found the job in another world than the one that last
        ran it (see ``world_change``)."""
        return self.world_change is not None

    @property
    def nodes(self) -> int:
        """The nodes of the job's group now: torchrun's ``GROUP_WORLD_SIZE``, else the world size
        divided by the processes per node."""
        env = self._env
        if env.get("GROUP_WORLD_SIZE", "").strip():
            return int(env["GROUP_WORLD_SIZE"])
        return max(1, self.world_size // max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1)))

    @property
    def is_main(self) -> bool:
        """Whether this process is global rank 0, the one that writes."""
        return self.rank == 0

    def __repr__(self) -> str:
        return (
            f"TrainingContext(source={self.source!r}, trial={self.trial!r},"
            f" rank={self.rank}/{self.world_size}, data_dir='{self.data_dir}',"
            f" checkpoint_dir='{self.checkpoint_dir}')"
        )

    def device_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Every rank: the ``DeviceMesh`` of ``self.parallelism``, dims ``pp``, ``dp``, ``tp`` (size-1
        ones kept; hybrid sharding adds ``dp_replicate`` and ``dp_shard``). See
        ``tunepod.runtime.parallel.device_mesh``."""
        return device_mesh(self.parallelism, device_type)

    def report(self, step: int, **values: float) -> None:
        """Rank 0: append ``{"step", "metrics", "time"}`` to the metrics file, flushed and fsynced.

        The orchestrator reads that file to prune and mirrors it into MLflow. Other ranks: no-op, so
        pass metrics that are already global (reduced across ranks) if they differ between ranks.
        Raises ``TypeError``/``ValueError`` on rank 0 for a non-numeric or non-finite value, or a
        metric name MLflow would refuse (``metrics.metric_name_problem``).
        """
        self.heartbeat(step)
        if not self.is_main:
            return
        report = metrics.append_report(self.metrics_file, step, values)
        self._last_reported_step = report.step

    def heartbeat(self, step: int | None = None) -> None:
        """Every rank: say the training loop advanced (cheap; call it each batch or so).

        In a job, each rank's heartbeat thread publishes when its loop last advanced, so the
        orchestrator tells a hung job (stuck in a collective, on a hung mount) from a slow one and
        stops it after the spec's ``train.hang_timeout_s``. ``report``, ``save_checkpoint`` and
        ``load_latest_checkpoint`` count as advancing too; call this in loops whose steps take longer
        than a few minutes between them.
        """
        if self._heartbeat is not None:
            self._heartbeat.advance(step)

    def step_done(self, step: int, *, samples: float | None = None, tokens: float | None = None) -> None:
        """Every rank: one training step (an optimizer step) ended; ``samples`` and ``tokens``: this
        rank's share of the step's work (under tensor or pipeline parallelism the ranks of one data
        replica split its batch's count, so a sum over the ranks is the job's throughput). A
        ``heartbeat(step)`` that also times the step.

        Each rank measures the wall time from one call to the next, samples and tokens per second,
        and its peak memory (CUDA's peak allocation when it uses CUDA, else its peak RSS), over the
        steps between two heartbeat writes, into its heartbeat file; the orchestrator exports them to
        Prometheus per rank and logs them to the trial's MLflow run (``rank<N>/step_time_s``, ...).
        Cheap (two clock reads, no I/O): call it after every step. Outside a job: no-op.
        """
        if self._heartbeat is not None:
            self._heartbeat.step_done(step, samples, tokens)

    def should_stop(self) -> bool:
        """Whether the job is being stopped (SIGTERM: preempted, requeued, pruned, at its time limit):
        save a checkpoint now and return from the script; the job resumes from it when it runs again.

        Every rank must call it at the same point of its loop: with ``torch.distributed`` initialized
        it is a collective (one all-reduce of a flag), so the ranks agree on the step they stop at and
        none is left waiting in a collective for a rank that already left. The first call also
        changes what SIGTERM does from killing at once to setting this flag, until the grace period
        (``resources.stop_grace_s``) runs out and SIGKILL follows.
        """
        stop = _any_rank(self._stop.requested(), self.world_size)
        self._stop_agreed = self._stop_agreed or stop
        return stop

    def save_checkpoint(
        self, state: Any, step: int, *, sharded: bool = False, async_save: bool | str = False
    ) -> Path | None:
        """Rank 0: save ``state`` as ``step-N`` atomically, keep the newest ``keep_checkpoints``.

        Returns the step folder on rank 0 and ``None`` on the others, which write nothing. Raises
        ``CheckpointStateError`` for a state that loading would refuse (see ``checkpoints``).

        ``sharded=True`` (every rank, a collective): each rank writes its own shard of ``state`` (a
        dict of tensors, DTensors, FSDP/TP ``state_dict()``s and plain values) with
        torch.distributed.checkpoint into the same step folder, and every rank gets the folder.
        ``async_save=True`` (or ``"process"``: DCP's writer process per rank instead of a thread)
        copies the state to CPU memory and returns while it is written; the next save,
        ``wait_for_checkpoint`` or ``finish`` waits for it and commits it. See ``sharded``.

        With checkpoint tiers (``checkpoint_tiers``; call it on every rank, a collective): the save
        goes to the shared folder as above when ``shared_every_steps`` passed since the last shared
        save or ``should_stop()`` said stop, and to node memory when ``memory_every_steps`` passed
        since the last memory save (a shared save goes there too); otherwise it does nothing and
        returns ``None``. A memory save copies the state to CPU buffers and returns; it is written,
        copied to ``memory_replicas`` peer nodes and pruned in the background (see
        ``tunepod.runtime.memory_tier``). Returns the shared step folder when the save went there,
        else the memory one (on the ranks that wrote).
        """
        self.heartbeat(step)
        if self.checkpoint_tiers is not None:
            return self._save_tiered(state, step, sharded, async_save)
        return self._save_shared(state, step, sharded, async_save)

    def _save_tiered(self, state: Any, step: int, sharded: bool, async_save: bool | str) -> Path | None:
        memory = self._memory_tier()
        targets = memory.targets(step, self._stop_agreed)
        shared = self._save_shared(state, step, sharded, async_save) if targets.shared else None
        in_memory = memory.save(state, step, sharded) if targets.memory else None
        memory.saved(step, targets)
        return shared or in_memory

    def _save_shared(self, state: Any, step: int, sharded: bool, async_save: bool | str) -> Path | None:
        if sharded:
            from tunepod.runtime.sharded import async_mode_of

            return self._sharded_checkpointer().save(state, step, async_mode_of(async_save))
        if async_save:
            raise ValueError("async_save needs sharded=True: a whole-state save is written by rank 0 alone")
        self.wait_for_checkpoint()  # rank 0's save clears hidden folders, an async one's among them
        if not self.is_main:
            return None
        return checkpoints.save_checkpoint(self.checkpoint_dir, state, step, self.keep_checkpoints)

    def wait_for_checkpoint(self) -> Path | None:
        """Every rank: wait for the async sharded save in flight and commit it, and for the memory
        save in flight; return the sharded save's folder, or ``None`` when none is in flight. Call it
        before leaving without ``finish`` (after a stop)."""
        if self._memory is not None:
            self._memory.wait()
        if self._sharded is None:
            return None
        return self._sharded.wait()

    def load_latest_checkpoint(self, *, into: dict[str, Any] | None = None) -> checkpoints.Checkpoint | None:
        """The newest valid checkpoint (state on the CPU), or ``None`` for a fresh start. Every rank.

        ``into`` (a collective; how a sharded step resumes): the state dict to load into, holding
        tensors of the saved shapes and shardings (DTensors may be sharded over another number of
        ranks than at the save); each rank reads only its part, and the returned ``state`` is
        ``into``. A non-sharded step still comes back whole in ``state``, ``into`` untouched.
        Without ``into`` a sharded step comes back whole in this process, each tensor on the CPU.

        With checkpoint tiers (every rank, a collective): the newest step complete in some live
        node's memory, or the shared folder's newest valid step when that is newer; each rank reads
        its files from its own node, else from a peer's, checksums verified. ``restored_from`` says
        which; rank 0 logs it and records it in the restores file (``tunepod.runtime.restores``),
        which the orchestrator mirrors into the trial's MLflow run.

        The first call also compares the job's world with the one that last ran it (with
        ``torch.distributed`` initialized, a collective: rank 0 reads the worlds file and tells the
        others) and sets ``world_change`` when it differs; rank 0 records the new world in the worlds
        file (``tunepod.runtime.worlds``), which the orchestrator mirrors into the trial's MLflow run
        as the metric ``tunepod.world_size``, and says the change in the job's log.
        """
        if self.checkpoint_tiers is not None:
            self.wait_for_checkpoint()
            memory = self._memory_tier()
            loaded, self.restored_from = memory.restore(into, self._sharded_checkpointer)
            if loaded is not None and self.is_main:
                restores.record_restore(
                    restores.restores_file(self.metrics_file), loaded.step, memory.restored_sources
                )
        elif into is None:
            loaded = checkpoints.load_latest_checkpoint(self.checkpoint_dir)
        else:
            loaded = self._sharded_checkpointer().load_latest(into)
        self._note_world(0 if loaded is None else loaded.step)
        self.heartbeat(None if loaded is None else loaded.step)
        return loaded

    def _note_world(self, step: int) -> None:
        """Once per process, every rank: compare this world with the last recorded one (rank 0 reads
        it; the others learn it from rank 0, which may be the only rank that sees the file), set
        ``world_change``, and (rank 0) record this world when it differs."""
        if self._world_noted:
            return
        self._world_noted = True
        path = worlds.worlds_file(self.metrics_file)
        last = worlds.last_world(path) if self.is_main else None
        sizes = _max_over_ranks(list(last) if last is not None else [0, 0], self.world_size)
        previous = (sizes[0], sizes[1]) if sizes[0] > 0 else None
        self.world_change = worlds.world_change(previous, self.world_size, self.nodes, step)
        if self.is_main:
            worlds.record_world(path, previous, self.world_size, self.nodes, step)

    def _memory_tier(self) -> MemoryTier:
        if self._memory is None:
            from tunepod.runtime.memory_tier import MemoryTier  # imports torch

            assert self.checkpoint_tiers is not None
            self._memory = MemoryTier(
                self.checkpoint_tiers,
                self.checkpoint_dir,
                self.keep_checkpoints,
                self.rank,
                self.world_size,
                {**self._env, "LOCAL_RANK": str(self.local_rank)},
            )
        self._memory.set_up()
        return self._memory

    def _sharded_checkpointer(self) -> ShardedCheckpointer:
        if self._sharded is None:
            from tunepod.runtime.sharded import ShardedCheckpointer  # imports torch

            self._sharded = ShardedCheckpointer(self.checkpoint_dir, self.keep_checkpoints, self.world_size)
        return self._sharded

    def finish(self, **values: float) -> None:
        """Rank 0: write the result file atomically with the final metrics; other ranks: no-op.

        Its ``step`` is the last step this process reported or, for a job resumed after its last
        report, the last step in the metrics file; ``None`` if nothing was ever reported. An async
        sharded save in flight is waited for and committed first (on every rank: call it on each).
        Refuses the values ``report`` refuses, names included. With checkpoint tiers (every rank, a
        collective): the newest memory step is copied to the shared folder when it is newer than the
        newest shared step, and the job's memory folders are removed.
        """
        self.wait_for_checkpoint()
        if self._memory is not None:
            self._memory.finish()
        if self._heartbeat is not None:
            self._heartbeat.finish()
        if not self.is_main:
            return
        step = self._last_reported_step
        if step is None:
            earlier = metrics.read_reports(self.metrics_file)
            step = earlier[-1].step if earlier else None
        metrics.write_result(self.result_file, values, step)


def init(
    defaults: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None
) -> TrainingContext:
    """Read the job's contract from the environment (``environ``, default ``os.environ``).

    ``defaults`` are the script's parameters, overridden by the job's (``TUNEPOD_PARAMS`` or
    SageMaker's ``SM_HPS``). Outside any job, folders default to ``<cwd>/.tunepod/local`` (see
    ``tunepod.runtime.contract``). In a job, starts this rank's heartbeat thread (see
    ``tunepod.runtime.progress``); outside one, creates nothing: folders appear when something is
    written.
    """
    env = os.environ if environ is None else environ
    contract = read_contract(env, defaults)
    heartbeat = None
    if contract.source != "local":
        folder = progress_dir(contract.metrics_file)
        interval_s, log_every_s = heartbeat_interval_s(env), progress_log_s(env)
        heartbeat = Heartbeat(folder, contract.rank, interval_s, log_every_s).start()
        if contract.rank == 0:
            forget_ranks_from(folder, contract.world_size)
    stop = StopRequest(heartbeat.stop_requested if heartbeat is not None else None).install()
    return TrainingContext(contract, heartbeat, stop, env)


def _any_rank(flag: bool, world_size: int) -> bool:
    """``flag`` OR-ed over every rank when ``torch.distributed`` is up; ``flag`` itself otherwise."""
    return bool(_max_over_ranks([1 if flag else 0], world_size)[0])


def _max_over_ranks(values: list[int], world_size: int) -> list[int]:
    """Each of ``values`` maxed over every rank when ``torch.distributed`` is up (one all-reduce);
    ``values`` themselves otherwise. With every rank but one giving zeros, a broadcast from that one.

    torch is looked up, not imported: a script that runs distributed has imported it already.
    """
    torch = sys.modules.get("torch")
    if world_size <= 1 or torch is None:
        return values
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return values
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    agreed = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return [int(value) for value in agreed.tolist()]
