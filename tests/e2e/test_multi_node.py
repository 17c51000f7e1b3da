"""Trials that span several real Slurm nodes, through `tunepod run` as a user runs it: the namespaced
nodes of ``scripts/slurm-up`` (partition ``nodes``, each node a slurmd with its own network namespace,
address and hostname), real torchrun agents meeting in a c10d rendezvous across the nodes' addresses,
gloo all-reduces between every rank (``collective.py``), a real Optuna journal and MLflow SQLite store.

Each test uses the whole partition (some kill a node), so they share one pytest group
(``slurm_nodes``): no other test's job runs on these nodes meanwhile.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from faults_support import (
    COLLECTIVE_TRAINER,
    NODES_LAUNCHER,
    FaultStudy,
    MakeRuns,
    assert_nothing_left,
    assert_study_complete,
    assert_tracked_once,
    assert_trained_once,
    nodes_of,
    placements,
    sqlite_tracking,
    starts,
    submission,
    wait_for,
)
from mlflow import MlflowClient
from slurm_cluster import (
    NODE_PARTITION,
    job_nodes,
    kill_node,
    restore_nodes,
    sbatch,
    wait_for_job,
)

from tunepod.launch.paths import JobPaths
from tunepod.runtime import read_reports

pytestmark = [pytest.mark.slow, pytest.mark.slurm_nodes(4)]


def multi_node_study(
    tmp_path: Path,
    *,
    num_trials: int,
    num_parallel: int,
    epochs: int,
    sleep_s: float,
    procs_per_node: int = 1,
    args: dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
) -> FaultStudy:
    """Trials of ``collective.py`` on two namespaced nodes each, each node the trial's alone."""
    return FaultStudy(
        tmp_path, "slurm", sqlite_tracking(tmp_path), num_trials=num_trials, num_parallel=num_parallel,
        epochs=epochs, sleep_s=sleep_s, trainer=COLLECTIVE_TRAINER, args=args or {},
        train={"resources": {"num_nodes": 2, "procs_per_node": procs_per_node}, **(train or {})},
        launcher_options=NODES_LAUNCHER,
    )  # fmt: skip


def report_window(job_dir: Path) -> tuple[float, float]:
    """When the trial's first and last reports were written (the ranks' clock)."""
    reports = read_reports(JobPaths(job_dir).metrics)
    return reports[0].time, reports[-1].time


def test_three_trials_of_two_nodes_on_four_nodes_two_run_and_one_waits_for_nodes(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Three trials in flight, each one Slurm job of two whole nodes with two processes per node, on
    four nodes: two run, the third waits in the queue for nodes, under hang and start-up limits shorter
    than its wait.

    Proves: every trial ran as one process group of four ranks over two distinct nodes (ranks 0-1 on
    one, 2-3 on the other: SLURMD_NODENAME differs between them, and each rank's hostname is its
    node's); the first two held four distinct nodes and trained at the same time; the third started
    only once one of them had ended, and its wait was taken neither for a hang nor for a failed start
    (no stop, no restart); each trial was trained and tracked once.
    """
    study = multi_node_study(
        tmp_path, num_trials=3, num_parallel=3, epochs=10, sleep_s=2.5, procs_per_node=2,
        # A start-up limit that four ranks over two nodes meet on a loaded 2-core CI machine (they took
        # over 15 s there), and trials long enough that the third's wait still exceeds it.
        train={"hang_timeout_s": 4, "startup_timeout_s": 30},
    )  # fmt: skip
    run = runs(study, TUNEPOD_HEARTBEAT_S="0.5").run("two-node-trials")

    trials = assert_study_complete(study)
    assert_trained_once(study)
    assert_tracked_once(study, trials)
    held: dict[int, list[str]] = {}
    for number, job_dir in study.job_dirs().items():
        [ranks] = placements(job_dir).values()
        assert [rank.rank for rank in ranks] == [0, 1, 2, 3], (number, ranks)
        assert all(rank.slurmd_nodename == rank.hostname for rank in ranks), (number, ranks)
        first, second = nodes_of(ranks)
        assert [rank.slurmd_nodename for rank in ranks] == [first, first, second, second], (number, ranks)
        held[number] = [first, second]
    windows = sorted((report_window(d), n) for n, d in study.job_dirs().items())
    ((start_a, end_a), a), ((start_b, end_b), b), ((start_c, _), _) = windows
    assert start_a < end_b and start_b < end_a, f"the first two trials did not train at once: {windows}"
    assert len({*held[a], *held[b]}) == 4, f"the first two trials shared a node: {held}"
    assert start_c > min(end_a, end_b), f"the third trial trained before a node was free: {windows}"
    assert "hung" not in run.output() and "restart" not in run.output(), run.tail()
    assert_nothing_left(study)


def take_node_away(how: str, node: str) -> None:
    """``kill``: every process in the node's namespaces SIGKILLed (slurmd, the job's steps and ranks),
    which Slurm sees as a node that stopped answering; ``down``: the controller's own decision
    (``scontrol update state=down``), which ends the job's steps on the node at once."""
    if how == "kill":
        kill_node(node)
    else:
        subprocess.run(
            ["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=tunepod-test"],
            check=True,
            capture_output=True,
            timeout=30,
        )


@pytest.mark.parametrize(("how", "victim_index"), [("kill", 0), ("down", 1)])
def test_a_node_lost_mid_trial_resumes_the_trial_from_its_checkpoint_on_other_nodes(
    runs: MakeRuns, tmp_path: Path, how: str, victim_index: int
) -> None:
    """Fault: one node of a running two-node trial is lost after a few epochs: killed (every process in
    it, the first node, where the batch script and the rendezvous live) or set DOWN by the controller
    (the second node; its slurmd lives on, so with ReturnToService=2 it is back at its next
    registration and may take the job again). The other trial runs on two other nodes.

    Proves: Slurm requeues the hit trial's job (or fails it, and tunepod restarts it), it runs again
    on two nodes (without the killed one), resumes from the newest checkpoint it had (no epoch after it
    trained twice, none skipped), and the study ends with both trials counted once: one Optuna trial
    and one MLflow run each, the other trial trained once. The node, back in service, takes jobs again.
    """
    study = multi_node_study(
        tmp_path, num_trials=2, num_parallel=2, epochs=6, sleep_s=1.0, train={"max_restarts": 1}
    )
    tunepod = runs(study)
    try:
        run = tunepod.start(f"node-{how}")
        hit = JobPaths(study.job_dir(0))
        wait_for(lambda: len(read_reports(hit.metrics)) >= 2, "trial 0 to report 2 epochs", running=run)
        victim = job_nodes(submission(hit.job_dir).job_id or "")[victim_index]
        take_node_away(how, victim)
        lost_at = len(read_reports(hit.metrics))
        assert run.wait() == 0, run.tail()

        assert_study_complete(study)
        first, second = placements(hit.job_dir).values()
        assert victim in nodes_of(first) and len(nodes_of(second)) == 2, (victim, first, second)
        if how == "kill":
            assert victim not in nodes_of(second), (victim, second)
        steps = [r.step for r in read_reports(hit.metrics)]
        resumed = [r.step for r in read_reports(hit.metrics) if r.time > second[0].started_at]
        # Resumed from the newest checkpoint: the epoch after it, then each epoch once, to the end.
        assert resumed == list(range(resumed[0], study.epochs)), steps
        assert resumed[0] > 0 and lost_at - 1 <= resumed[0] <= lost_at + 1, (lost_at, steps)
        assert sorted(set(steps)) == list(range(study.epochs)), steps
        assert starts(hit.job_dir) == 2 and starts(study.job_dir(1)) == 1
        output = run.output()
        assert (
            "was requeued or is restarting; it resumes from its checkpoints" in output
            or "restart 1 of 1" in output
        ), run.tail()
        client = MlflowClient(study.tracking_uri)
        found = client.search_runs(
            [client.get_experiment_by_name("faults").experiment_id], "tags.`tunepod.study` = 'quad'"
        )
        assert sorted(int(r.data.tags["tunepod.trial"]) for r in found) == [0, 1]
        assert_nothing_left(study)
    finally:
        restore_nodes()
    everywhere = sbatch(
        f"--partition={NODE_PARTITION}", "--nodes=4", "--ntasks-per-node=1", "--mem=16M",
        f"--chdir={tmp_path}", "--output=hosts.log", "--wrap=srun hostname",
    )  # fmt: skip
    assert wait_for_job(everywhere)["JobState"] == "COMPLETED"
    assert victim in (tmp_path / "hosts.log").read_text().split()


def test_a_rank_on_the_second_node_that_hangs_is_stopped_and_the_trial_resumes(
    runs: MakeRuns, tmp_path: Path
) -> None:
    """Fault: a real hang on the second node. Rank 1 of a two-node job (its only rank there) stops
    joining all-reduces at epoch 2 while rank 0, on the first node, waits in one: both processes
    live, neither loop advances.

    Proves: the orchestrator, which reads every rank's heartbeat from the shared tree, says the job is
    hung and names rank 1 on the second node as alive but stuck, stops the job (scancel reaches both
    nodes: nothing is left) and the restart resumes from the epoch-1 checkpoint; the trial completes,
    counted once.
    """
    study = multi_node_study(
        tmp_path, num_trials=1, num_parallel=1, epochs=4, sleep_s=0.2,
        args={"hang_at_epoch": 2, "hang_rank": 1}, train={"hang_timeout_s": 4, "max_restarts": 1},
    )  # fmt: skip
    run = runs(study, TUNEPOD_HEARTBEAT_S="0.5").run("hang-on-second-node")

    assert_study_complete(study)
    job_dir = study.job_dir(0)
    first, _ = placements(job_dir).values()
    second_node = first[1].slurmd_nodename
    assert second_node != first[0].slurmd_nodename, first
    assert starts(job_dir) == 2 and submission(job_dir).attempt == 2
    assert [report.step for report in read_reports(JobPaths(job_dir).metrics)] == [0, 1, 2, 3]
    output = run.output()
    assert "is hung, stopping it: no progress for" in output, run.tail()
    assert re.search(rf"rank 1 on {second_node} pid \d+ advanced \d+ s ago, alive", output), run.tail()
    assert "hung; restart 1 of 1, resuming from its checkpoints" in output, run.tail()
    assert_nothing_left(study)
