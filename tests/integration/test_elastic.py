"""An elastic job for real: two torchrun agents on this host stand in for two nodes (each with its own
memory folder through its own ``TUNEPOD_CHECKPOINT_TIERS``), started with the launchers' elastic
arguments (``--nnodes=1:2``, ``--max-restarts``, the rendezvous timings of ``tunepod.launch.elastic``)
and a c10d rendezvous that node a hosts, as the first node of a Slurm job does. Losing node b is
SIGKILL to its agent's process group and to its worker's session; its memory folder goes too.

Checked, whole-state and sharded (gloo, CPU): the survivor's agent re-forms the group alone, without
any restart from outside; its new worker restores the newest memory step (8, not shared step 6;
sharded, complete through the copy of b's shard that b pushed to a), learns through
``ctx.world_change`` that the world went from 2 processes on 2 nodes to 1 on 1 at step 8, records it
in the worlds file and the log, trains to the end and finishes; the job (agent a) exits 0. The time
from the kill to the new worker's restore is printed.

Saves (memory every 2 steps, shared every 6): steps 0 and 6 go to both tiers, 2, 4 and 8 to memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from stand_in_nodes import NODES, REPO, StandInNodes

from tunepod import runtime
from tunepod.launch.elastic import rdzv_conf, torchrun_elastic_args
from tunepod.runtime.restores import read_restores, restores_file
from tunepod.runtime.worlds import read_worlds, worlds_file
from tunepod.spec.resources import Resources

pytest.importorskip("torch")

JOB = REPO / "tests/fixtures/jobs/elastic.py"
MODES = ["whole", "sharded"]
TIMEOUT_S = 120
ELASTIC = Resources(num_nodes=2, min_nodes=1, procs_per_node=1)


def elastic_agent_args(node: str, port: int) -> list[str]:
    """The launchers' elastic arguments. Node a hosts the rendezvous store (on a cluster: the first
    node, whose hostname the endpoint names); here both agents share one host, so say which."""
    host = "1" if node == "a" else "0"
    elastic = [arg for arg in torchrun_elastic_args(ELASTIC) if not arg.startswith("--rdzv-conf")]
    return [
        *elastic,
        f"--rdzv-conf={rdzv_conf()},is_host={host}",
        *("--nproc-per-node", "1", "--rdzv-backend", "c10d"),
        *("--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", str(port)),
    ]


def first_round(node: str) -> str:
    """What the worker of the agent's first round (``TORCHELASTIC_RESTART_COUNT`` 0) saw."""
    return f"node-{node}-round0.json"


@pytest.fixture
def job(tmp_path: Path) -> Iterator[StandInNodes]:
    started = StandInNodes(tmp_path, JOB, elastic_agent_args, first_round, TIMEOUT_S)
    yield started
    started.stop_all()


@pytest.mark.parametrize("mode", MODES)
def test_the_survivors_re_form_without_the_lost_node_and_go_on_from_the_newest_memory_step(
    job: StandInNodes, mode: str
) -> None:
    job.start(mode, "9", "11")
    job.wait_until(lambda: all((job.out / f"ready-{n}.json").exists() for n in NODES), "both ranks at step 9")
    assert [job.seen(first_round(n))["world_size"] for n in NODES] == [2, 2]
    assert [c.step for c in runtime.valid_checkpoints(job.checkpoints)] == [6, 0]

    killed_at = time.time()
    job.kill("b")
    job.lose_memory("b")
    job.finished("a")

    # (1) Node a's agent started a new worker by itself (round 1): alone, rank 0 of a world of 1.
    after = job.seen("node-a-round1.json")
    print(f"elastic continue: {after['time'] - killed_at:.1f} s from the kill to the restored step")
    assert (after["rank"], after["world_size"], after["nodes"]) == (0, 1, 1)
    # (2) It went on from memory step 8, the newest (shared step 6 is older), from its own memory. In
    # sharded mode step 8 is complete only with b's shard, which a holds as the copy b pushed to it.
    assert after["restored"] == {"step": 8, "w": 8.0, "step_in_state": 8}
    assert after["from"] == "own memory"
    (restore,) = read_restores(restores_file(job.metrics))
    assert (restore.step, restore.tier) == (8, "own memory")
    # (3) The training contract said the world changed, and rank 0 recorded it and logged it.
    assert after["world_change"] == {
        "step": 8,
        "previous_world_size": 2,
        "world_size": 1,
        "previous_nodes": 2,
        "nodes": 1,
    }
    worlds = read_worlds(worlds_file(job.metrics))
    assert [(w.step, w.world_size, w.nodes) for w in worlds] == [(0, 2, 2), (8, 1, 1)]
    assert "world size changed from 2 (2 node(s)) to 1 (1 node(s)) at step 8" in job.logs(tail=10**6)
    # (4) The job finished in the same run: one result, the newest memory step flushed to shared.
    assert runtime.read_result(job.tmp / "result.json") is not None
    assert [c.step for c in runtime.valid_checkpoints(job.checkpoints)][:2] == [10, 6]
    steps = [report.step for report in runtime.read_reports(job.metrics)]
    assert steps == [*range(10), 9, 10, 11]  # step 9 trained again after the restore of 8, no other
