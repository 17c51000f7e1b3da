"""The memory tier for real: a two-node job, whose nodes are two torchrun agents on this one host
(``--nnodes 2 --nproc-per-node 1``, c10d rendezvous), each given its own memory folder through its own
``TUNEPOD_CHECKPOINT_TIERS``, so each agent stands in for a node with its own RAM. Killing a node is
SIGKILL to its agent's process group and to its worker's (torchrun starts each worker in a session of
its own); deleting its memory folder stands in for the node's RAM going with it.

Checked, whole-state and sharded (gloo, CPU): memory saves reach the peer's memory; after a node is
lost, the restart restores the newest memory step, the lost node's rank from the peer's copy and the
other from its own memory, not the older shared step; a node killed between a memory save and its
copy to the peer leaves the previous complete step chosen; ``finish`` copies the newest memory step
to the shared folder and removes the memory folders.

Saves (memory every 2 steps, shared every 6): steps 0 and 6 go to both tiers, 2, 4 and 8 to memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from stand_in_nodes import NODES, REPO, StandInNodes

from tunepod import runtime
from tunepod.runtime.restores import read_restores, restores_file

pytest.importorskip("torch")

JOB = REPO / "tests/fixtures/jobs/memory_tier.py"
MODES = ["whole", "sharded"]
TIMEOUT_S = 90


def two_node_agent_args(node: str, port: int) -> list[str]:
    """A fixed two-node job (no restarts), its c10d rendezvous on this host."""
    return [
        *("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0"),
        *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", str(port)),
    ]


def seen_file(node: str) -> str:
    return f"node-{node}.json"


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[StandInNodes]:
    job = StandInNodes(tmp_path, JOB, two_node_agent_args, seen_file, TIMEOUT_S)
    yield job
    job.stop_all()


def manifests(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("manifest-rank*.json")}


@pytest.mark.parametrize("mode", MODES)
def test_a_lost_node_restores_the_newest_memory_step_from_its_peer_and_finish_flushes_it(
    nodes: StandInNodes, mode: str
) -> None:
    writers = {"manifest-rank0.json", "manifest-rank1.json"} if mode == "sharded" else {"manifest-rank0.json"}
    nodes.start(mode, "9", "hold")
    nodes.wait_until(
        lambda: all((nodes.out / f"ready-{n}.json").exists() for n in NODES), "both ranks at step 9"
    )
    # (1) Every writer's step 8 is on both nodes: its own and the peer's copy.
    for node in NODES:
        assert manifests(nodes.job_folder(node) / "step-000008") == writers
    assert [c.step for c in runtime.valid_checkpoints(nodes.checkpoints)] == [6, 0]

    nodes.kill("b")
    nodes.lose_memory("b")
    nodes.kill("a")  # the job goes down with its node; its restart runs on both nodes again

    nodes.start(mode, "11", "finish")
    nodes.finished()
    # (2) Step 8, the newest memory step (not shared step 6): b from a's copy, a from its own memory.
    a, b = nodes.seen(seen_file("a")), nodes.seen(seen_file("b"))
    for seen in (a, b):
        offset = 1000 * seen["rank"] if mode == "sharded" else 0
        assert seen["restored"] == {"step": 8, "w": 8.0 + offset, "step_in_state": 8}
    assert a["from"] == "own memory"
    assert b["from"].startswith("peer memory (127.0.0.1:")
    assert "restored step 8 from rank 0 " in nodes.logs(tail=10**6)
    # (3) Rank 0 recorded the restore for the orchestrator's MLflow mirror: the job's is a peer's.
    (restore,) = read_restores(restores_file(nodes.metrics))
    assert (restore.step, restore.tier) == (8, "peer memory")
    assert sorted(source.split(" (")[0] for source in restore.sources) == ["own memory", "peer memory"]
    # (4) finish copied memory step 10 (newer than shared step 6) to the shared folder, then
    # removed the memory folders.
    assert [c.step for c in runtime.valid_checkpoints(nodes.checkpoints)][:2] == [10, 6]
    assert runtime.latest_checkpoint(nodes.checkpoints) is not None
    for node in NODES:
        assert list((nodes.memory_dir(node) / "tunepod").iterdir()) == []


@pytest.mark.parametrize("mode", MODES)
def test_a_node_killed_between_a_memory_save_and_its_peer_copy_leaves_the_previous_step_chosen(
    nodes: StandInNodes, mode: str
) -> None:
    nodes.start(mode, "9", "hold", "8")  # rank 0 kills its node as it is about to copy step 8
    nodes.wait_until(
        lambda: any(agent.poll() is not None for agent in nodes.agents.values()), "rank 0's node to die"
    )
    lost = next(node for node, agent in nodes.agents.items() if agent.poll() is not None)
    (survivor,) = set(NODES) - {lost}
    nodes.kill(lost)  # its worker's session too
    nodes.lose_memory(lost)
    nodes.kill(survivor)
    # Step 8 of rank 0 never reached the survivor; step 6 did.
    assert "manifest-rank0.json" not in manifests(nodes.job_folder(survivor) / "step-000008")
    assert "manifest-rank0.json" in manifests(nodes.job_folder(survivor) / "step-000006")

    nodes.start(mode, "11", "finish")
    nodes.finished()
    for node, source in ((survivor, "own memory"), (lost, "peer memory")):
        seen = nodes.seen(seen_file(node))
        assert seen["restored"]["step"] == 6 and seen["from"].startswith(source)
