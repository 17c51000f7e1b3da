"""The worlds file and ``ctx.world_change``, in one process (the collective that shares rank 0's
reading is exercised for real in tests/integration/test_elastic.py): a job's first world is recorded,
a restart in another world sees the change and records it, one in the same world records nothing; and
rank 0 forgets the heartbeats of ranks a smaller world no longer has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tunepod import runtime
from tunepod.runtime.progress import forget_ranks_from
from tunepod.runtime.worlds import WorldChange, read_worlds, record_world, worlds_file


def job_env(tmp_path: Path, world_size: int, nodes: int) -> dict[str, str]:
    return {
        runtime.CHECKPOINT_DIR_ENV: str(tmp_path / "checkpoints"),
        runtime.RESULT_FILE_ENV: str(tmp_path / "result.json"),
        runtime.METRICS_FILE_ENV: str(tmp_path / "metrics.jsonl"),
        "RANK": "0",
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(nodes),
    }


def started(tmp_path: Path, world_size: int, nodes: int) -> runtime.TrainingContext:
    ctx = runtime.init(environ=job_env(tmp_path, world_size, nodes))
    ctx.load_latest_checkpoint()
    return ctx


def test_a_restart_in_a_smaller_world_sees_the_change_and_records_it(tmp_path: Path) -> None:
    first = started(tmp_path, 4, 2)
    assert first.world_change is None and not first.world_size_changed  # a fresh start
    first.save_checkpoint({"w": 1}, 8)

    again = started(tmp_path, 4, 2)  # the same world: nothing new
    assert again.world_change is None

    smaller = started(tmp_path, 2, 1)
    assert smaller.world_change == WorldChange(8, 4, 2, 2, 1)
    assert smaller.world_size_changed and smaller.world_change.scale == 0.5
    assert str(smaller.world_change) == "world size changed from 4 (2 node(s)) to 2 (1 node(s)) at step 8"
    recorded = read_worlds(worlds_file(tmp_path / "metrics.jsonl"))
    assert [(w.step, w.world_size, w.nodes, w.previous_world_size) for w in recorded] == [
        (0, 4, 2, None),
        (8, 2, 1, 4),
    ]


def test_the_change_is_said_in_the_jobs_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "worlds.jsonl"
    record_world(path, None, 4, 2, 0)
    record_world(path, (4, 2), 2, 1, 8)
    err = capsys.readouterr().err
    assert err.count("world size changed") == 1
    assert "tunepod.runtime: world size changed from 4 (2 node(s)) to 2 (1 node(s)) at step 8" in err


def test_a_torn_last_line_is_not_a_world_yet(tmp_path: Path) -> None:
    path = tmp_path / "worlds.jsonl"
    record_world(path, None, 4, 2, 0)
    with path.open("a") as torn:
        torn.write('{"step": 8, "world_si')
    assert [w.world_size for w in read_worlds(path)] == [4]


def test_rank_0_forgets_the_heartbeats_of_ranks_a_smaller_world_has_not(tmp_path: Path) -> None:
    for rank in range(4):
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps({"rank": rank}))
    forget_ranks_from(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.glob("rank-*.json")) == ["rank-0.json", "rank-1.json"]
