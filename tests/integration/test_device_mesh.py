"""``ctx.device_mesh()`` for real: 4 gloo CPU processes build the mesh of three layouts from
``TUNEPOD_PARALLELISM`` and all-reduce their rank over each named axis, so each group's sum says which
ranks it holds. The ranks are forked, so torch is imported once, in the parent: 0.5 s here, where
spawning 4 interpreters that each import torch takes ~20 s on 2 cores; the children touch neither
logging nor anything of the parent's threads, only torch and gloo."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

from tunepod import runtime
from tunepod.runtime import Parallelism

torch = pytest.importorskip("torch")

WORLD = 4
LAYOUTS = {
    "data2_tensor2": Parallelism(data=2, tensor=2),
    "pipeline2_data2": Parallelism(data=2, pipeline=2, sharding="full", shard=2),
    "hybrid": Parallelism(data=4, sharding="hybrid", shard=2),
}


def _rank_main(rank: int, port: int, out: Path) -> None:
    import torch.distributed as dist

    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD)}
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    seen: dict[str, Any] = {}
    for name, layout in LAYOUTS.items():
        ctx = runtime.init(environ={**env, runtime.PARALLELISM_ENV: layout.to_json()})
        mesh = ctx.device_mesh("cpu")  # the first one starts the gloo process group
        names = mesh.mesh_dim_names or ()
        sums = {}
        for axis in (*names, "dp"):
            value = torch.tensor([rank])
            dist.all_reduce(value, group=mesh[axis].get_group())
            sums[axis] = int(value.item())
        seen[name] = {"shape": list(mesh.shape), "names": list(names), "sums": sums}
    dist.destroy_process_group()
    (out / f"rank-{rank}.json").write_text(json.dumps(seen))


def test_the_mesh_has_the_layout_and_each_axis_groups_the_right_ranks(tmp_path: Path) -> None:
    fork = multiprocessing.get_context("fork")
    port = free_port()
    procs = [fork.Process(target=_rank_main, args=(rank, port, tmp_path)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():  # a rank stuck in a collective: do not leave it behind
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0] * WORLD
    seen = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(WORLD)]

    # data 2 x tensor 2: tensor ranks are neighbours ({0,1}, {2,3}), data ranks stride over them.
    assert seen[0]["data2_tensor2"]["shape"] == [1, 2, 2]
    assert seen[0]["data2_tensor2"]["names"] == ["pp", "dp", "tp"]
    assert [s["data2_tensor2"]["sums"]["tp"] for s in seen] == [1, 1, 5, 5]
    assert [s["data2_tensor2"]["sums"]["dp"] for s in seen] == [2, 4, 2, 4]
    assert [s["data2_tensor2"]["sums"]["pp"] for s in seen] == [0, 1, 2, 3]  # size-1 axis: itself

    # pipeline 2 x data 2: stages are the outer axis.
    assert seen[0]["pipeline2_data2"]["shape"] == [2, 2, 1]
    assert [s["pipeline2_data2"]["sums"]["pp"] for s in seen] == [2, 4, 2, 4]
    assert [s["pipeline2_data2"]["sums"]["dp"] for s in seen] == [1, 1, 5, 5]

    # hybrid: shards over neighbours, replicas across them, dp their flattened whole.
    hybrid = seen[0]["hybrid"]
    assert hybrid["shape"] == [1, 2, 2, 1]
    assert hybrid["names"] == ["pp", "dp_replicate", "dp_shard", "tp"]
    assert [s["hybrid"]["sums"]["dp_shard"] for s in seen] == [1, 1, 5, 5]
    assert [s["hybrid"]["sums"]["dp_replicate"] for s in seen] == [2, 4, 2, 4]
    assert [s["hybrid"]["sums"]["dp"] for s in seen] == [6, 6, 6, 6]
