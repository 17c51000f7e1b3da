"""A node lost mid-trial costs the steps since the last memory save, not since the last shared one:
checkpoint tiers on the multi-node Slurm cluster, through `tunepod run` as a user runs it.

Each trial runs ``collective.py`` on two namespaced nodes (gloo all-reduces between the nodes) with
``train.checkpoints`` set: every step to node memory (each node's own ``/dev/shm``, a tmpfs in its
mount namespace, see ``scripts/slurm/common.sh``) and copied to the other node's memory, every
third step to the shared file system too (steps 0, 3, 6, 9). On its first start rank 0 stops
advancing at step 5 (the trainer's ``hang_at_epoch``: it sleeps before reporting it) once steps
0..4 are reported and saved, so the kill comes after memory step 4 (newer than shared step 3)
reached the other node, and before anything else was reported. The other two nodes are held by
sleeping jobs meanwhile, so the requeued trial comes back to its own two nodes once they are up.
Some tests hold the trainer once more to make a second loss: at step 8 of the second start, or inside
the second start's restore (rank 0's first fetch from the other node waits, see ``collective.py``).

Every fault is real: ``scripts/slurm-node kill`` SIGKILLs every process of a node, and the node's
memory (its tmpfs) ends with them; ``slurm-node start`` brings it back with empty memory, as a
rebooted node. The trial's job log (rank 0's ``restored step N from ...``) and its MLflow run (tags
``tunepod.restored_from``, ``tunepod.restored_step``) say which tier the restart restored from.

These tests use the whole partition, so they share the ``slurm_nodes`` pytest group with the other
tests of the namespaced nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from faults_support import (
    COLLECTIVE_TRAINER,
    EXPERIMENT,
    METRIC,
    NODES_LAUNCHER,
    STUDY,
    FaultStudy,
    MakeRuns,
    assert_nothing_left,
    assert_study_complete,
    assert_tracked_once,
    nodes_of,
    placements,
    sqlite_tracking,
    starts,
    study_processes,
    submission,
    wait_for,
)
from mlflow import MlflowClient
from mlflow.entities import Run
from optuna.trial import FrozenTrial
from slurm_cluster import (
    job_nodes,
    kill_node,
    node_memory,
    restore_nodes,
    slurm_node,
    wait_for_node,
)
from tiers_support import (
    DOWN,
    memory_step,
    node_address,
    others_held,
    restored,
    restores,
    shared_step,
)

from tunepod.launch.paths import JobPaths
from tunepod.runtime import read_reports
from tunepod.runtime.memory_store import job_folder
from tunepod.tracking import tags

pytestmark = [pytest.mark.slow, pytest.mark.slurm_nodes(4)]

EPOCHS = 10
TIERS = {"memory_every_steps": 1, "shared_every_steps": 3, "memory_replicas": 1}
HELD_AT = 5
"""The step rank 0 stops before on the first start: steps 0..4 reported and saved."""
NEWEST_MEMORY, NEWEST_SHARED = HELD_AT - 1, 3
"""What the nodes' memory and the shared folder hold when the nodes are killed."""


def tiered_study(tmp_path: Path, max_restarts: int = 1, **args: object) -> FaultStudy:
    """One trial of ``collective.py`` on two whole namespaced nodes, with checkpoint tiers; ``args``
    are more of the trainer's params (a second hang, a hold in the restore, a sharded state)."""
    return FaultStudy(
        tmp_path, "slurm", sqlite_tracking(tmp_path), num_trials=1, num_parallel=1, epochs=EPOCHS,
        sleep_s=1.0, trainer=COLLECTIVE_TRAINER, args={"hang_at_epoch": HELD_AT, "hang_rank": 0, **args},
        train={"resources": {"num_nodes": 2}, "checkpoints": TIERS, "max_restarts": max_restarts},
        launcher_options=NODES_LAUNCHER,
    )  # fmt: skip


@dataclass(frozen=True)
class Kill:
    """One loss of nodes: once ``marker`` is in the trial's job dir (a hold of its trainer) and, when
    ``memory`` is set, that step is complete in the memory of each of the trial's nodes, the trial's
    nodes ``victims`` (by rank order) are killed, then started again, empty, once Slurm has them down."""

    marker: str
    victims: slice
    memory: int | None = NEWEST_MEMORY


FIRST_HOLD = Kill("hung.once", slice(0, 1))
"""Rank 0's node, once rank 0 holds at step 5 with memory step 4 on both nodes."""


@dataclass(frozen=True)
class NodeLoss:
    """What a trial's node losses left to check."""

    study: FaultStudy
    output: str
    nodes: list[str]
    """The trial's nodes on its first start, rank 0's first."""
    killed: list[list[str]]
    shared_at_kill: list[int | None]
    memory_at_kill: list[dict[str, int | None]]
    """Each node's newest complete memory step just before each kill."""


def lose_nodes(runs: MakeRuns, tmp_path: Path, *kills: Kill, study: FaultStudy | None = None) -> NodeLoss:
    """Run the study (by default ``tiered_study``), make each of ``kills`` in turn while the other
    two nodes are held, so that the trial comes back to its own two, and let the trial finish."""
    study = study or tiered_study(tmp_path)
    tunepod = runs(study)
    hit = JobPaths(study.job_dir(0))
    try:
        run = tunepod.start("memory-tier")
        wait_for(
            lambda: (
                (hit.job_dir / "nodes.log").exists()
                and [len(ranks) for ranks in placements(hit.job_dir).values()] == [2]
            ),
            "both ranks of the trial to start",
            running=run,
        )
        [ranks] = placements(hit.job_dir).values()
        nodes = nodes_of(ranks)
        assert sorted(nodes) == sorted(job_nodes(submission(hit.job_dir).job_id or "")), nodes
        killed, shared_at_kill, memory_at_kill = [], [], []
        with others_held(nodes, tmp_path):
            for kill in kills:
                wait_for(lambda: (hit.job_dir / kill.marker).exists(), kill.marker, running=run)  # noqa: B023
                if kill.memory is not None:
                    wait_for(
                        lambda: all(memory_step(n, hit.checkpoints) == kill.memory for n in nodes),  # noqa: B023
                        f"memory step {kill.memory} on both nodes (each rank's own and the other's copy)",
                        running=run,
                    )
                memory_at_kill.append({node: memory_step(node, hit.checkpoints) for node in nodes})
                killed.append(nodes[kill.victims])
                for node in killed[-1]:
                    kill_node(node)
                shared_at_kill.append(shared_step(hit.checkpoints))
                for node in killed[-1]:
                    wait_for_node(node, DOWN)
                    slurm_node("start", node)
                    assert memory_step(node, hit.checkpoints) is None, f"{node}'s memory outlived its kill"
            assert run.wait() == 0, run.tail()
        assert_nothing_left(study)
        return NodeLoss(study, run.output(), nodes, killed, shared_at_kill, memory_at_kill)
    finally:
        restore_nodes()


def trial_run(study: FaultStudy) -> Run:
    """The trial's only MLflow run."""
    client = MlflowClient(study.tracking_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id], f"tags.`{tags.STUDY}` = '{STUDY}'")
    return found


def reported_by_each_start(job_dir: Path) -> list[list[int]]:
    """The steps each start of the trial's script reported, in order."""
    begun = list(placements(job_dir))
    reports = read_reports(JobPaths(job_dir).metrics)
    ends = [*begun[1:], float("inf")]
    return [[r.step for r in reports if start < r.time < end] for start, end in zip(begun, ends, strict=True)]


def assert_resumed_after(loss: NodeLoss, step: int) -> None:
    """The trial started twice, both times on its own two nodes, and its second start trained each
    step after ``step`` once, to the end."""
    job_dir = loss.study.job_dir(0)
    first, second = placements(job_dir).values()
    assert nodes_of(first) == loss.nodes and sorted(nodes_of(second)) == sorted(loss.nodes), (first, second)
    assert starts(job_dir) == 2
    assert reported_by_each_start(job_dir)[1] == list(range(step + 1, EPOCHS))


def assert_tagged(run: Run, step: int, tier: str) -> None:
    """The run's tags name its last restore; ``tunepod.restores`` lists the restores in order."""
    assert run.data.tags[tags.PREFIX + tags.RESTORED_FROM] == tier, run.data.tags
    assert run.data.tags[tags.PREFIX + tags.RESTORED_STEP] == str(step), run.data.tags
    listed = json.loads(run.data.tags[tags.PREFIX + tags.RESTORES])
    assert (listed[-1]["step"], listed[-1]["tier"]) == (step, tier), listed


def assert_one_run_holding_every_report(study: FaultStudy, trial: FrozenTrial) -> None:
    """The trial's one MLflow run holds each line of its metrics file once (a step trained again
    after the restore is a second line, and a second point), and ends with its objective."""
    run = trial_run(study)
    assert run.info.status == "FINISHED" and run.data.tags[tags.STATE] == "COMPLETE", run.data.tags
    reports = read_reports(JobPaths(study.job_dir(0)).metrics)
    history = MlflowClient(study.tracking_uri).get_metric_history(run.info.run_id, METRIC)
    assert sorted((m.step, m.timestamp, m.value) for m in history) == sorted(
        (r.step, int(r.time * 1000), r.metrics[METRIC]) for r in reports
    )
    assert reports[-1].metrics[METRIC] == pytest.approx(trial.value)


SECOND_HOLD = 8
"""The step rank 0 stops before on its second start (steps 5..7 trained since the first restore)."""


def test_a_trial_that_loses_one_node_then_the_other_restores_from_memory_both_times(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault, twice in a row: rank 0's node is killed after memory step 4 (shared step 3); the trial
    restores and trains on, and rank 0 holds again at step 8; then the other node, the one that gave
    step 4 to the first restore, is killed after memory step 7 (shared step 6).

    Proves: each restore took the newest memory step, not the newer shared one, from the node that
    survived that loss: step 4, which the restarted first node (empty memory) fetched from the second
    node's memory (the log names that node's address) while the second read its own; then step 7,
    which the restarted first node had saved since, read from its own memory and fetched by the
    second. No step was trained twice: the three starts reported 0..4, 5..7 and 8..9. The trial is
    one Optuna trial and one MLflow run, whose tags name the last restore and list both; the driver
    logged each requeue. The job's memory folders are gone from both nodes at the end (``ctx.finish``
    flushed step 9 to the shared folder first).
    """
    study = tiered_study(tmp_path, max_restarts=2, hang_again_at_epoch=SECOND_HOLD)
    second_kill = Kill("hung.again", slice(1, 2), memory=SECOND_HOLD - 1)
    loss = lose_nodes(runs, tmp_path, FIRST_HOLD, second_kill, study=study)

    first, second = loss.nodes
    assert loss.killed == [[first], [second]]
    assert loss.memory_at_kill[0] == {first: NEWEST_MEMORY, second: NEWEST_MEMORY}
    assert loss.shared_at_kill == [NEWEST_SHARED, 6]
    job_dir = loss.study.job_dir(0)
    (step_4, where_4), (step_7, where_7) = restores(job_dir)
    assert step_4 == NEWEST_MEMORY > NEWEST_SHARED, where_4
    assert f"rank 0 peer memory ({node_address(second)}:" in where_4, where_4
    assert "rank 1 own memory" in where_4, where_4
    assert step_7 == SECOND_HOLD - 1 and f"rank 1 peer memory ({node_address(first)}:" in where_7, where_7
    assert "rank 0 own memory" in where_7, where_7
    assert reported_by_each_start(job_dir) == [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9]]
    trials = assert_study_complete(loss.study)
    assert_tracked_once(loss.study, trials)
    run = trial_run(loss.study)
    assert_tagged(run, SECOND_HOLD - 1, "peer memory")
    assert [(r["step"], r["tier"]) for r in json.loads(run.data.tags[tags.PREFIX + tags.RESTORES])] == [
        (NEWEST_MEMORY, "peer memory"),
        (SECOND_HOLD - 1, "peer memory"),
    ]
    # Slurm requeues the job, or ends it and the driver submits it again: either way, two restarts.
    logged = loss.output.count("was requeued or is restarting; it resumes") + loss.output.count("; restart ")
    assert logged == 2, loss.output[-3000:]
    assert shared_step(JobPaths(job_dir).checkpoints) == EPOCHS - 1
    assert all(memory_step(node, JobPaths(job_dir).checkpoints) is None for node in loss.nodes)


def test_a_node_killed_during_a_restore_from_it_leaves_the_shared_step_to_restore(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault: rank 0's node is killed after memory step 4 (shared step 3); on the restart, while rank
    0 (on that node, back with empty memory) is fetching step 4 from the other node's memory, that
    node is killed too: the only copy of step 4 is gone, in the middle of a restore.

    Proves: the interrupted restore left nothing that passes for a step (no ``restored`` line from
    that start, nothing reported by it), and the next start restores shared step 3 and trains each
    step after it once (step 4 a second time, the one step lost); the trial is one Optuna trial and
    one MLflow run holding each report once, tagged with the shared file system's step.
    """
    study = tiered_study(tmp_path, max_restarts=2, hold_restore_s=8)
    during_restore = Kill("restoring.once", slice(1, 2), memory=None)
    loss = lose_nodes(runs, tmp_path, FIRST_HOLD, during_restore, study=study)

    first, second = loss.nodes
    assert loss.killed == [[first], [second]]
    # When the second kill came, only the second node held step 4: the first came back empty.
    assert loss.memory_at_kill[1] == {first: None, second: NEWEST_MEMORY}
    assert loss.shared_at_kill == [NEWEST_SHARED, NEWEST_SHARED]
    job_dir = loss.study.job_dir(0)
    assert restores(job_dir) == [(NEWEST_SHARED, "shared file system")]
    # The interrupted start's log names what failed: the fetch from the dead node, not only the
    # collective that broke with it.
    log = JobPaths(job_dir).stderr.read_text(errors="replace")
    assert f"no node could give step-{NEWEST_MEMORY:06d}/" in log and node_address(second) in log, log[-3000:]
    assert reported_by_each_start(job_dir) == [[0, 1, 2, 3, 4], [], list(range(NEWEST_SHARED + 1, EPOCHS))]
    trials = assert_study_complete(loss.study)
    assert_one_run_holding_every_report(loss.study, trials[0])
    assert_tagged(trial_run(loss.study), NEWEST_SHARED, "shared file system")


def test_when_the_second_node_is_lost_the_first_keeps_its_memory_for_the_requeued_job(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault: the second node of a trial with a sharded state (each rank writes its own shard, DCP) is
    killed after memory step 4 reached both nodes; the batch script, on the first node, lives on and
    its exit trap runs when Slurm tears the job down for the requeue.

    Proves: the trap told the requeue from an end for good and left the first node's memory alone:
    the requeued job restores step 4 (not shared step 3), rank 0 its shard from its own node's
    memory, rank 1 (on the restarted node) its shard from the copy in the first node's memory, each
    rank checking it got its own shard back; each step after it is trained once; the trial is one
    Optuna trial and one MLflow run."""
    loss = lose_nodes(runs, tmp_path, Kill("hung.once", slice(1, 2)), study=tiered_study(tmp_path, sharded=1))

    first, second = loss.nodes
    assert loss.killed == [[second]]
    step, where = restored(loss.study.job_dir(0))
    assert step == NEWEST_MEMORY > NEWEST_SHARED, where
    assert where.startswith(f"rank 0 own memory, rank 1 peer memory ({node_address(first)}:"), where
    trials = assert_study_complete(loss.study)
    assert_resumed_after(loss, step)
    assert_tracked_once(loss.study, trials)


def rank_zero_worker(study: FaultStudy) -> int:
    """The pid of rank 0's training process (a torchrun worker: ``RANK=0`` and torchrun's run id)."""
    for pid in study_processes(study):
        with contextlib.suppress(OSError):
            environ = b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
            if b"\0RANK=0\0" in environ and b"\0TORCHELASTIC_RUN_ID=" in environ:
                return pid
    pytest.fail("rank 0's training process is not running")


def test_a_trial_that_ends_without_finish_leaves_no_memory_folder_on_its_nodes(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault: rank 0's training process (its process group: torchrun starts each worker in a session
    of its own) is SIGKILLed while it holds at step 5, memory step 4 on both nodes; no restart
    (``max_restarts: 0``), so the trial fails without ever calling ``ctx.finish``.

    Proves: the batch script's exit trap removed the job's memory folder on both nodes (the job was
    still RUNNING, not requeued: it ended for good), and nothing of the job is left running."""
    train = {"resources": {"num_nodes": 2}, "checkpoints": TIERS, "max_restarts": 0}
    study = FaultStudy(
        tmp_path, "slurm", sqlite_tracking(tmp_path), num_trials=1, num_parallel=1, epochs=EPOCHS,
        sleep_s=1.0, trainer=COLLECTIVE_TRAINER, args={"hang_at_epoch": HELD_AT, "hang_rank": 0},
        train=train, launcher_options=NODES_LAUNCHER,
    )  # fmt: skip
    hit = JobPaths(study.job_dir(0))
    run = runs(study).start("memory-folder")
    wait_for(lambda: (hit.job_dir / "hung.once").exists(), f"rank 0 to hold at {HELD_AT}", running=run)
    [ranks] = placements(hit.job_dir).values()
    nodes = nodes_of(ranks)
    wait_for(
        lambda: all(memory_step(node, hit.checkpoints) == NEWEST_MEMORY for node in nodes),
        f"memory step {NEWEST_MEMORY} on both nodes",
        running=run,
    )
    os.killpg(os.getpgid(rank_zero_worker(study)), signal.SIGKILL)

    run.wait()
    assert_nothing_left(study)
    assert not hit.result.exists(), "the killed trial reported a result"
    left = {node: job_folder(node_memory(node), hit.checkpoints) for node in nodes}
    assert not any(folder.exists() for folder in left.values()), left
    assert starts(hit.job_dir) == 1
