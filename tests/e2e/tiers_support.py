"""What the node-loss tests of checkpoint tiers and elastic trials share: where each node's memory and
the shared folder stand, holding the other nodes so a requeued trial comes back to its own, and what a
job's log says it restored (``tests/e2e/test_memory_tier_nodes.py``, ``test_elastic_nodes.py``)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from slurm_cluster import NODE_PARTITION, namespaced_nodes, node_memory, sbatch, scancel, wait_for_job

from tunepod.launch.paths import JobPaths
from tunepod.runtime.checkpoints import newest_valid_checkpoint
from tunepod.runtime.memory_store import choose_restore, job_folder, list_job_folder

DOWN = frozenset({"down*", "down"})
"""A killed node's states once the controller has given up on it."""
RESTORED_LINE = re.compile(r"restored step (\d+) from (.+)")


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


def node_address(node: str) -> str:
    """A namespaced node's address on the cluster's bridge (``scripts/slurm/common.sh``)."""
    return f"10.231.0.{10 + int(node.removeprefix('n'))}"


def restores(job_dir: Path) -> list[tuple[int, str]]:
    """The step and the source(s) of each ``restored step N from ...`` line of the job's log."""
    lines = RESTORED_LINE.findall(JobPaths(job_dir).stderr.read_text(errors="replace"))
    return [(int(step), where) for step, where in lines]


def restored(job_dir: Path) -> tuple[int, str]:
    """The last restore the job's log says."""
    found = restores(job_dir)
    assert found, f"no 'restored step' line in {JobPaths(job_dir).stderr}"
    return found[-1]
