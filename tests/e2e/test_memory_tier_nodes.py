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
import re
import signal
from collections.abc import Iterator
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
    NODE_PARTITION,
    job_nodes,
    kill_node,
    namespaced_nodes,
    node_memory,
    restore_nodes,
    sbatch,
    scancel,
    slurm_node,
    wait_for_job,
    wait_for_node,
)

from tunepod.launch.paths import JobPaths
from tunepod.runtime import read_reports
from tunepod.runtime.checkpoints import newest_valid_checkpoint
from tunepod.runtime.memory_store import choose_restore, job_folder, list_job_folder
from tunepod.tracking import tags

pytestmark = [pytest.mark.slow, pytest.mark.slurm_nodes(4)]

EPOCHS = 10
TIERS = {"memory_every_steps": 1, "shared_every_steps": 3, "memory_replicas": 1}
HELD_AT = 5
"""The step rank 0 stops before on the first start: steps 0..4 reported and saved."""
NEWEST_MEMORY, NEWEST_SHARED = HELD_AT - 1, 3
"""What the nodes' memory and the shared folder hold when the nodes are killed."""
DOWN = frozenset({"down*", "down"})
RESTORED_LINE = re.compile(r"restored step (\d+) from (.+)")


def tiered_study(tmp_path: Path) -> FaultStudy:
    """One trial of ``collective.py`` on two whole namespaced nodes, with checkpoint tiers."""
    return FaultStudy(
        tmp_path, "slurm", sqlite_tracking(tmp_path), num_trials=1, num_parallel=1, epochs=EPOCHS,
        sleep_s=1.0, trainer=COLLECTIVE_TRAINER, args={"hang_at_epoch": HELD_AT, "hang_rank": 0},
        train={"resources": {"num_nodes": 2}, "checkpoints": TIERS, "max_restarts": 1},
        launcher_options=NODES_LAUNCHER,
    )  # fmt: skip


def memory_step(node: str, checkpoint_dir: Path) -> int | None:
    """The newest step of the trial complete in ``node``'s memory (every writer's manifest and files
    there), as the job's restore would judge it; None when the node holds none."""
    folder = job_folder(node_memory(node), checkpoint_dir)
    plan = choose_restore({0: list_job_folder(folder)}, None)
    return None if plan is None else plan.step


def shared_step(checkpoint_dir: Path) -> int | None:
    found = newest_valid_checkpoint(checkpoint_dir)
    return None if found is None else found.step


@contextlib.contextmanager
def others_held(trial_nodes: list[str], tmp_path: Path) -> Iterator[None]:
    """Every namespaced node but the trial's runs a sleeping job of its own, so the trial, requeued,
    can only come back to its own nodes. Cancelled on leaving."""
    options = [f"--partition={NODE_PARTITION}", "--exclusive", "--mem=16M", "--job-name=tunepod-hold"]
    options += [f"--chdir={tmp_path}", "--output=/dev/null", "--wrap=sleep 900"]
    held = [sbatch(*options, f"--nodelist={node}") for node in namespaced_nodes() if node not in trial_nodes]
    try:
        for job_id in held:
            wait_for_job(job_id, frozenset({"RUNNING"}))
        yield
    finally:
        for job_id in held:
            scancel(job_id)


@dataclass(frozen=True)
class NodeLoss:
    """What a trial's node loss left to check."""

    study: FaultStudy
    output: str
    nodes: list[str]
    """The trial's nodes, rank 0's first."""
    killed: list[str]
    shared_at_kill: int | None
    memory_at_kill: dict[str, int | None]
    """Each node's newest complete memory step just before the kill."""


def lose_nodes(runs: MakeRuns, tmp_path: Path, victims: slice) -> NodeLoss:
    """Run the study and, once rank 0 holds at step 5, kill the trial's nodes ``victims`` (by rank
    order), bring them back with empty memory once Slurm has them down, and let the trial finish."""
    study = tiered_study(tmp_path)
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
        with others_held(nodes, tmp_path):
            wait_for(
                lambda: (hit.job_dir / "hung.once").exists(), f"rank 0 to hold at {HELD_AT}", running=run
            )
            wait_for(
                lambda: all(memory_step(node, hit.checkpoints) == NEWEST_MEMORY for node in nodes),
                f"memory step {NEWEST_MEMORY} on both nodes (rank 0's own and the copy)",
                running=run,
            )
            memory_at_kill = {node: memory_step(node, hit.checkpoints) for node in nodes}
            killed = nodes[victims]
            for node in killed:
                kill_node(node)
            shared_at_kill = shared_step(hit.checkpoints)
            for node in killed:
                wait_for_node(node, DOWN)
                slurm_node("start", node)
                assert memory_step(node, hit.checkpoints) is None, f"{node}'s memory outlived its kill"
            assert run.wait() == 0, run.tail()
        assert_nothing_left(study)
        return NodeLoss(study, run.output(), nodes, killed, shared_at_kill, memory_at_kill)
    finally:
        restore_nodes()


def restored(job_dir: Path) -> tuple[int, str]:
    """The step and the source(s) of the last ``restored step N from ...`` line of the job's log."""
    lines = RESTORED_LINE.findall(JobPaths(job_dir).stderr.read_text(errors="replace"))
    assert lines, f"no 'restored step' line in {JobPaths(job_dir).stderr}"
    step, where = lines[-1]
    return int(step), where


def trial_run(study: FaultStudy) -> Run:
    """The trial's only MLflow run."""
    client = MlflowClient(study.tracking_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id], f"tags.`{tags.STUDY}` = '{STUDY}'")
    return found


def assert_resumed_after(loss: NodeLoss, step: int) -> None:
    """The trial started twice, both times on its own two nodes, and its second start trained each
    step after ``step`` once, to the end."""
    job_dir = loss.study.job_dir(0)
    first, second = placements(job_dir).values()
    assert nodes_of(first) == loss.nodes and sorted(nodes_of(second)) == sorted(loss.nodes), (first, second)
    assert starts(job_dir) == 2
    reports = read_reports(JobPaths(job_dir).metrics)
    resumed = [r.step for r in reports if r.time > second[0].started_at]
    assert resumed == list(range(step + 1, EPOCHS)), [r.step for r in reports]


def assert_tagged(run: Run, step: int, tier: str) -> None:
    assert run.data.tags[tags.PREFIX + tags.RESTORED_FROM] == tier, run.data.tags
    assert run.data.tags[tags.PREFIX + tags.RESTORED_STEP] == str(step), run.data.tags
    (listed,) = json.loads(run.data.tags[tags.PREFIX + tags.RESTORES])
    assert (listed["step"], listed["tier"]) == (step, tier), listed


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


def test_the_rank_of_a_killed_node_restores_the_newest_memory_step_from_the_surviving_node(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault: rank 0's node (which also runs the batch script and the rendezvous) is killed after
    memory step 4 reached the other node; shared step 3 is the newest on the shared file system.

    Proves: the restart restores step 4, not 3: the rank on the restarted node (empty memory)
    fetches it from the surviving node's memory (the log names that node's address), the other
    rank reads its own; the log line and the MLflow run's tags say so; steps 5..9 are trained once,
    after nothing else was reported, so every step is reported, and tracked, once; the trial is one
    Optuna trial and one MLflow run. The job's memory folders are gone from both nodes at the end
    (``ctx.finish`` flushed step 9 to the shared folder first).
    """
    loss = lose_nodes(runs, tmp_path, slice(0, 1))

    survivor = loss.nodes[1]
    assert loss.memory_at_kill == {node: NEWEST_MEMORY for node in loss.nodes}
    assert loss.shared_at_kill == NEWEST_SHARED
    job_dir = loss.study.job_dir(0)
    step, where = restored(job_dir)
    assert step == NEWEST_MEMORY > NEWEST_SHARED
    # One rank read its own node's copy, the other fetched it from the survivor's memory.
    assert "own memory" in where and f"peer memory ({node_address(survivor)}:" in where, (where, survivor)
    trials = assert_study_complete(loss.study)
    assert_resumed_after(loss, step)
    assert_tracked_once(loss.study, trials)
    assert_tagged(trial_run(loss.study), step, "peer memory")
    assert shared_step(JobPaths(job_dir).checkpoints) == EPOCHS - 1
    assert all(memory_step(node, JobPaths(job_dir).checkpoints) is None for node in loss.nodes)
    assert (
        "was requeued or is restarting; it resumes from its checkpoints" in loss.output
        or "restart 1 of 1" in loss.output
    )


def test_when_both_copies_of_a_memory_step_are_lost_the_trial_restores_the_shared_step(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault: both nodes of the trial are killed after memory step 4 reached both: every copy of it
    is gone with them, and the nodes come back with empty memory.

    Proves: the restart falls back to the shared file system's newest step, 3 (the log line and the
    MLflow tags say ``shared file system``), trains each step after it once (step 4 a second time,
    the one step lost), and the trial is one Optuna trial and one MLflow run holding each report
    once.
    """
    loss = lose_nodes(runs, tmp_path, slice(0, 2))

    assert loss.killed == loss.nodes
    assert loss.memory_at_kill == {node: NEWEST_MEMORY for node in loss.nodes}
    assert loss.shared_at_kill == NEWEST_SHARED
    step, where = restored(loss.study.job_dir(0))
    assert (step, where) == (NEWEST_SHARED, "shared file system")
    trials = assert_study_complete(loss.study)
    assert_resumed_after(loss, step)
    assert_one_run_holding_every_report(loss.study, trials[0])
    assert_tagged(trial_run(loss.study), step, "shared file system")


def test_when_the_second_node_is_lost_the_first_keeps_its_memory_for_the_requeued_job(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault: the trial's second node is killed after memory step 4 reached it; the batch script, on
    the first node, lives on and its exit trap runs when Slurm tears the job down for the requeue.

    Proves: the trap told the requeue from an end for good and left the first node's memory alone:
    the requeued job restores step 4 (not shared step 3), rank 0 from its own node's memory, and
    trains each step after it once; the trial is one Optuna trial and one MLflow run."""
    loss = lose_nodes(runs, tmp_path, slice(1, 2))

    assert loss.killed == loss.nodes[1:]
    step, where = restored(loss.study.job_dir(0))
    assert step == NEWEST_MEMORY > NEWEST_SHARED, where
    assert where.startswith("own memory") or "rank 0 own memory" in where, where
    trials = assert_study_complete(loss.study)
    assert_resumed_after(loss, step)
    assert_tracked_once(loss.study, trials)


def node_address(node: str) -> str:
    """A namespaced node's address on the cluster's bridge (``scripts/slurm/common.sh``)."""
    return f"10.231.0.{10 + int(node.removeprefix('n'))}"


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
