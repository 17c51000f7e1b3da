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

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

from tunepod import runtime
from tunepod.runtime.restores import read_restores, restores_file

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests/fixtures/jobs/memory_tier.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
NODES = ("a", "b")
MODES = ["whole", "sharded"]
TIMEOUT_S = 90


class TwoNodes:
    """One job's folders, and its two stand-in nodes started as torchrun agents."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.out = tmp / "out"
        self.out.mkdir()
        self.checkpoints = tmp / "checkpoints"
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def memory_dir(self, node: str) -> Path:
        return self.tmp / f"shm-{node}"

    def job_folder(self, node: str) -> Path:
        (found,) = (self.memory_dir(node) / "tunepod").iterdir()
        return found

    def start(self, *args: str) -> None:
        for path in self.out.iterdir():
            path.unlink()
        port = free_port()
        for node in NODES:
            tiers = runtime.CheckpointTiers(2, 6, memory_replicas=1, memory_dir=str(self.memory_dir(node)))
            env = {
                **os.environ,
                "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}",
                runtime.CHECKPOINT_DIR_ENV: str(self.checkpoints),
                runtime.METRICS_FILE_ENV: str(self.tmp / "metrics.jsonl"),
                runtime.RESULT_FILE_ENV: str(self.tmp / "result.json"),
                runtime.CHECKPOINT_TIERS_ENV: tiers.to_json(),
                "TEST_OUT": str(self.out),
                "TEST_NODE": node,
                "OMP_NUM_THREADS": "1",
            }
            command = [
                str(TORCHRUN),
                *("--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0"),
                *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", str(port)),
                str(JOB),
                *args,
            ]
            log = open(self.tmp / f"agent-{node}.log", "ab")  # noqa: SIM115 - the agent keeps it
            self.agents[node] = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_until(self, ready: Any, what: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}; logs:\n{self.logs()}")
            time.sleep(0.2)

    def kill(self, node: str) -> None:
        """The node is gone: its agent's process group and its worker's, SIGKILLed."""
        seen = self.out / f"node-{node}.json"
        groups = [self.agents[node].pid] + ([json.loads(seen.read_text())["pid"]] if seen.exists() else [])
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self.agents[node].wait(timeout=30)

    def lose_memory(self, node: str) -> None:
        """The node's RAM went with it."""
        shutil.rmtree(self.memory_dir(node))

    def finished(self) -> None:
        for node, agent in self.agents.items():
            try:
                assert agent.wait(timeout=TIMEOUT_S) == 0, f"agent {node} failed; logs:\n{self.logs()}"
            except subprocess.TimeoutExpired:
                pytest.fail(f"agent {node} did not finish; logs:\n{self.logs()}")

    def seen(self, node: str) -> dict[str, Any]:
        return dict(json.loads((self.out / f"node-{node}.json").read_text()))

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(p.read_text(errors="replace")[-tail:] for p in sorted(self.tmp.glob("agent-*.log")))

    def stop_all(self) -> None:
        for node in self.agents:
            if self.agents[node].poll() is None:
                self.kill(node)


@pytest.fixture
def nodes(tmp_path: Path) -> Any:
    job = TwoNodes(tmp_path)
    yield job
    job.stop_all()


def manifests(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("manifest-rank*.json")}


@pytest.mark.parametrize("mode", MODES)
def test_a_lost_node_restores_the_newest_memory_step_from_its_peer_and_finish_flushes_it(
    nodes: TwoNodes, mode: str
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
    a, b = nodes.seen("a"), nodes.seen("b")
    for seen in (a, b):
        offset = 1000 * seen["rank"] if mode == "sharded" else 0
        assert seen["restored"] == {"step": 8, "w": 8.0 + offset, "step_in_state": 8}
    assert a["from"] == "own memory"
    assert b["from"].startswith("peer memory (127.0.0.1:")
    assert "restored step 8 from rank 0 " in nodes.logs(tail=10**6)
    # (3) Rank 0 recorded the restore for the orchestrator's MLflow mirror: the job's is a peer's.
    (restore,) = read_restores(restores_file(nodes.tmp / "metrics.jsonl"))
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
    nodes: TwoNodes, mode: str
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
        seen = nodes.seen(node)
        assert seen["restored"]["step"] == 6 and seen["from"].startswith(source)
