"""An elastic trial loses a node and goes on with the other, in the same Slurm job: ``resources:
{num_nodes: 2, min_nodes: 1}`` with checkpoint tiers, through `tunepod run` on the multi-node Slurm
cluster, as a user runs it.

The trial runs ``collective.py`` on two namespaced nodes (gloo all-reduces between them), saving every
step to node memory and every third step to the shared file system too (steps 0 and 3 before the
fault). On its first start rank 1, on the second node, stops advancing at step 5 (the trainer's
``hang_at_epoch``: it sleeps instead of joining the all-reduce), while rank 0, on the first node, waits
in that all-reduce with steps 0..4 reported and saved. Then the second node is killed for real
(``scripts/slurm-node kill``: every process in it, its memory with them). Rank 0's all-reduce fails,
its torchrun agent re-forms the group alone (``--nnodes=1:2``) while Slurm, told ``--no-kill``, keeps
the job and the step running; the script starts again in a world of one, restores memory step 4 (newer
than shared step 3) from its own node, and trains 5..9.

These tests use the whole partition, so they share the ``slurm_nodes`` pytest group with the other
tests of the namespaced nodes.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from faults_support import (
    COLLECTIVE_TRAINER,
    EXPERIMENT,
    NODES_LAUNCHER,
    STUDY,
    FaultStudy,
    MakeRuns,
    assert_nothing_left,
    assert_study_complete,
    nodes_of,
    placements,
    sqlite_tracking,
    starts,
    submission,
    wait_for,
)
from mlflow import MlflowClient
from slurm_cluster import job_nodes, kill_node, restore_nodes, show_job, slurm_node, wait_for_node
from tiers_support import DOWN, memory_step, node_address, others_held, restores, shared_step

from tunepod.launch.paths import JobPaths
from tunepod.runtime import read_reports, read_worlds
from tunepod.tracking import tags

pytestmark = [pytest.mark.slow, pytest.mark.slurm_nodes(4)]

EPOCHS = 10
HELD_AT = 5
"""The step rank 1 stops before on the first start: steps 0..4 reported and saved."""
NEWEST_MEMORY = HELD_AT - 1
TIERS = {"memory_every_steps": 1, "shared_every_steps": 3, "memory_replicas": 1}
RESTORED_LINE = re.compile(r"restored step (\d+) from (.+)")


def elastic_study(tmp_path: Path, hang_rank: int = 1) -> FaultStudy:
    """One trial of ``collective.py`` on two whole namespaced nodes, elastic down to one."""
    return FaultStudy(
        tmp_path, "slurm", sqlite_tracking(tmp_path), num_trials=1, num_parallel=1, epochs=EPOCHS,
        sleep_s=1.0, trainer=COLLECTIVE_TRAINER, args={"hang_at_epoch": HELD_AT, "hang_rank": hang_rank},
        train={"resources": {"num_nodes": 2, "min_nodes": 1}, "checkpoints": TIERS, "max_restarts": 1},
        launcher_options=NODES_LAUNCHER,
    )  # fmt: skip


def test_an_elastic_trial_that_loses_its_second_node_goes_on_alone_in_the_same_job(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault: the trial's second node is killed while rank 0 waits for it in an all-reduce, after
    memory step 4 (shared step 3).

    Proves: no requeue and no restart by tunepod (one Slurm job id from start to end, the script
    started twice inside it: on two nodes, then on the first alone); the second start restores step 4
    from its own node's memory, ``ctx.world_change`` says 2 -> 1 (the job log says so too), and steps
    5..9 are trained once each; the trial is one complete Optuna trial and one MLflow run, whose metric
    ``tunepod.world_size`` holds 2 at step 0 and 1 at step 4.
    """
    study = elastic_study(tmp_path)
    tunepod = runs(study)
    hit = JobPaths(study.job_dir(0))
    try:
        run = tunepod.start("elastic")
        wait_for(
            lambda: (hit.job_dir / "hung.once").exists(), f"rank 1 to hold at step {HELD_AT}", running=run
        )
        [ranks] = placements(hit.job_dir).values()
        first, second = nodes_of(ranks)
        job_id = submission(hit.job_dir).job_id or ""
        assert job_nodes(job_id) == [first, second], "rank 0 runs on the job's first node"
        killed_at = time.time()
        kill_node(second)
        assert run.wait() == 0, run.tail()
        assert_nothing_left(study)
        output = run.output()
    finally:
        restore_nodes()

    # (1) One job, never requeued nor restarted by tunepod; the script started twice inside it.
    assert submission(hit.job_dir).job_id == job_id
    assert show_job(job_id).get("Restarts") == "0", show_job(job_id)
    assert "was requeued" not in output and "restart 1 of" not in output, output[-3000:]
    assert starts(hit.job_dir) == 2
    before, after = placements(hit.job_dir).values()
    assert (nodes_of(before), nodes_of(after)) == ([first, second], [first])
    print(f"elastic continue: {after[0].started_at - killed_at:.1f} s from the kill to the second start")
    # (2) The second start went on from memory step 4, on its own node, in a world of one.
    lines = RESTORED_LINE.findall(hit.stderr.read_text(errors="replace"))
    assert lines and lines[-1] == (str(NEWEST_MEMORY), "own memory"), lines
    log = hit.stderr.read_text(errors="replace")
    assert f"world size changed from 2 (2 node(s)) to 1 (1 node(s)) at step {NEWEST_MEMORY}" in log
    worlds = read_worlds(hit.worlds)
    assert [(w.step, w.world_size, w.nodes) for w in worlds] == [(0, 2, 2), (NEWEST_MEMORY, 1, 1)]
    resumed = [r.step for r in read_reports(hit.metrics) if r.time > after[0].started_at]
    assert resumed == list(range(NEWEST_MEMORY + 1, EPOCHS))
    # (3) One complete trial, one MLflow run recording the change.
    assert_study_complete(study)
    client = MlflowClient(study.tracking_uri)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    assert experiment is not None
    (trial_run,) = client.search_runs([experiment.experiment_id], f"tags.`{tags.STUDY}` = '{STUDY}'")
    name = tags.PREFIX + tags.WORLD_SIZE
    history = sorted((m.step, m.value) for m in client.get_metric_history(trial_run.info.run_id, name))
    assert history == [(0, 2.0), (NEWEST_MEMORY, 1.0)]
    assert trial_run.data.tags[name] == "1"


def test_an_elastic_trial_that_loses_its_first_node_is_requeued_and_restores_from_the_other(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault: the first node of an elastic trial is killed while rank 0, on it, holds at step 5, after
    memory step 4 reached the second node (shared step 3). That node runs the job's batch script and
    torchrun's rendezvous, so no survivor can re-form the group: the case the launcher documents as
    falling back to a requeue and a restore. The other two nodes are held, so the trial comes back to
    its own two nodes (the first started again with empty memory).

    Proves: the fallback happens. Slurm (22.05), told ``--no-kill``, takes the node out of the job
    and keeps it RUNNING on the second node, where nothing can go on; the Slurm launcher sees the
    job's batch host gone from its nodes, says so, and requeues it asking for its two nodes again
    (the same job id, one Slurm restart). The second start, on both nodes, restores step 4, rank 0
    fetching it from the second node's memory (not shared step 3), and trains each step after it
    once; the trial is one complete Optuna trial.
    """
    study = elastic_study(tmp_path, hang_rank=0)
    hit = JobPaths(study.job_dir(0))
    try:
        run = runs(study).start("elastic-first-node")
        wait_for(lambda: (hit.job_dir / "hung.once").exists(), f"rank 0 to hold at {HELD_AT}", running=run)
        [ranks] = placements(hit.job_dir).values()
        first, second = nodes_of(ranks)
        job_id = submission(hit.job_dir).job_id or ""
        assert job_nodes(job_id) == [first, second]
        with others_held([first, second], tmp_path):
            wait_for(
                lambda: all(memory_step(node, hit.checkpoints) == NEWEST_MEMORY for node in (first, second)),
                f"memory step {NEWEST_MEMORY} on both nodes",
                running=run,
            )
            assert shared_step(hit.checkpoints) == 3
            kill_node(first)
            wait_for_node(first, DOWN)
            slurm_node("start", first)
            assert run.wait() == 0, run.tail()
        assert_nothing_left(study)
        output = run.output()
    finally:
        restore_nodes()

    # Slurm kept the job RUNNING on the second node alone; tunepod requeued it, the same job.
    assert f"slurm job {job_id} lost its first node {first}" in output, output[-3000:]
    assert submission(hit.job_dir).job_id == job_id and show_job(job_id).get("Restarts") == "1"
    assert starts(hit.job_dir) == 2
    before, after = placements(hit.job_dir).values()
    assert (nodes_of(before), sorted(nodes_of(after))) == ([first, second], sorted([first, second]))
    [(step, where)] = restores(hit.job_dir)
    assert step == NEWEST_MEMORY and f"peer memory ({node_address(second)}:" in where, where
    resumed = [r.step for r in read_reports(hit.metrics) if r.time > after[0].started_at]
    assert resumed == list(range(NEWEST_MEMORY + 1, EPOCHS))
    assert_study_complete(study)
