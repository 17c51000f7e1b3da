"""Sharded checkpoints for real: gloo CPU processes save a DTensor, a replicated tensor, plain values
and an FSDP2 model with its optimizer through ``ctx.save_checkpoint(..., sharded=True)``,
synchronously and asynchronously (while a training step changes the state), load on another number
of ranks (2 -> 4, 2 -> 1), and are SIGKILLed while an async save is in flight. The ranks are forked
(torch is imported once, in the parent; see test_device_mesh.py) and meet through a FileStore, so no
port is needed."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from tmpfs import MiB, fill, mounted_tmpfs

from tunepod import runtime
from tunepod.errors import DiskFullError
from tunepod.runtime import checkpoints

torch = pytest.importorskip("torch")
# The first DTensor imports torch._dynamo (~300 modules, 2 s); importing it here, once, spares each
# forked rank doing it again (5 s each on 2 busy cores).
pytest.importorskip("torch._dynamo")

from tunepod.runtime.sharded import ShardedCheckpointer  # noqa: E402 - imports torch

ROWS = 8  # divisible by 1, 2 and 4 ranks
FULL = torch.arange(ROWS * 3, dtype=torch.float32).reshape(ROWS, 3)


def _context(rank: int, world: int, tmp: Path) -> runtime.TrainingContext:
    import torch.distributed as dist

    store = tmp / f"store-{world}"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    env = {
        runtime.CHECKPOINT_DIR_ENV: str(tmp / "checkpoints"),
        runtime.METRICS_FILE_ENV: str(tmp / "metrics.jsonl"),
        runtime.RESULT_FILE_ENV: str(tmp / "result.json"),
        runtime.KEEP_CHECKPOINTS_ENV: "2",
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
    }
    return runtime.init(environ=env)


def _sharded_state(world: int, step: int) -> dict[str, Any]:
    """A DTensor sharded by rows over every rank, a replicated tensor and plain values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    weights = distribute_tensor(FULL.clone() if step else torch.zeros(ROWS, 3), mesh, [Shard(0)])
    bias = torch.arange(5.0) if step else torch.zeros(5)
    return {"model": {"w": weights, "b": bias}, "step": step, "config": {"dim": 3, "names": ["a"]}}


def _fsdp(world: int) -> tuple[Any, Any]:
    """A tiny model under FSDP2 (``fully_shard`` over every rank) and its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _train_step(model: Any, optimizer: Any) -> None:
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _fsdp_state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, moments = get_state_dict(model, optimizer)
    return {"model": weights, "optimizer": moments}


def _full_weights(model: Any) -> list[Any]:
    """Every parameter whole (a collective), as lists."""
    return [parameter.full_tensor().tolist() for parameter in model.parameters()]


def _save_and_train(rank: int, world: int, tmp: Path) -> None:
    """Step 1 synchronous; step 2 async while a training step changes the state; step 3 async,
    committed by finish. Each rank writes what it saw to ``rank-N.json``."""
    ctx = _context(rank, world, tmp)
    state = _sharded_state(world, step=1)
    # A state only rank 1 cannot save: every rank hears of it, none waits in a collective.
    refused = {**state, "extra": Path("/x") if rank == 1 else "x"}
    seen: dict[str, Any] = {"refused": _error_of(lambda: ctx.save_checkpoint(refused, 1, sharded=True))}
    first = ctx.save_checkpoint(state, 1, sharded=True)
    seen["first_committed"] = first is not None and first.exists()
    model, optimizer = _fsdp(world)
    _train_step(model, optimizer)
    state["step"], state["fsdp"] = 2, _fsdp_state(model, optimizer)
    seen["fsdp_weights_at_step2"] = _full_weights(model)
    ctx.save_checkpoint(state, 2, sharded=True, async_save=True)
    # The next training step, while step 2 is written: it changes the saved tensors in place.
    state["model"]["b"].add_(100.0)
    state["model"]["w"].to_local().add_(100.0)
    _train_step(model, optimizer)
    seen["step2_before_next_save"] = (tmp / "checkpoints" / "step-000002").exists()
    state["step"], state["fsdp"] = 3, _fsdp_state(model, optimizer)
    ctx.save_checkpoint(state, 3, sharded=True, async_save=True)  # commits 2, writes 3
    seen["step2_after_next_save"] = (tmp / "checkpoints" / "step-000002").exists()
    ctx.report(3, loss=1.0)
    ctx.finish(loss=1.0)  # commits 3
    (tmp / f"rank-{rank}.json").write_text(json.dumps(seen))


def _error_of(action: Any) -> str:
    try:
        action()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:60]
    return "nothing raised"


def _load_resharded_then_die(rank: int, world: int, tmp: Path) -> None:
    """Load the newest step sharded over ``world`` ranks, then die (SIGKILL) while an async save of
    step 4 is in flight."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    ctx = _context(rank, world, tmp)
    into = _sharded_state(world, step=0)
    model, optimizer = _fsdp(world)
    into["fsdp"] = _fsdp_state(model, optimizer)
    loaded = ctx.load_latest_checkpoint(into=into)
    set_state_dict(
        model, optimizer, model_state_dict=into["fsdp"]["model"], optim_state_dict=into["fsdp"]["optimizer"]
    )
    rows = ROWS // world
    expected = FULL[rank * rows : (rank + 1) * rows]  # step 2's, staged before the training step
    seen = {
        "step": None if loaded is None else loaded.step,
        "shard_matches": bool(torch.equal(into["model"]["w"].to_local(), expected)),
        "bias": into["model"]["b"].tolist(),
        "plain": [into["step"], into["config"]],
        "fsdp_weights": _full_weights(model),
    }
    _train_step(model, optimizer)  # the loaded optimizer state is usable
    (tmp / f"rank-{rank}.json").write_text(json.dumps(seen))
    ctx.save_checkpoint(into, 4, sharded=True, async_save=True)
    os.kill(os.getpid(), signal.SIGKILL)


def run_ranks(target: Any, world: int, tmp: Path) -> list[int | None]:
    """Run ``target(rank, world, tmp)`` in ``world`` forked processes; their exit codes."""
    fork = multiprocessing.get_context("fork")
    processes = [fork.Process(target=target, args=(rank, world, tmp)) for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    return [process.exitcode for process in processes]


def seen_by(tmp: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((tmp / f"rank-{rank}.json").read_text()) for rank in range(world)]


def test_sharded_async_saves_commit_in_order_and_reshard_on_load(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    assert run_ranks(_save_and_train, 2, tmp_path) == [0, 0]
    refusals = [seen["refused"] for seen in seen_by(tmp_path, 2)]
    assert refusals[0].startswith("RuntimeError: another rank could not save this state")
    assert refusals[1].startswith("CheckpointStateError: the checkpoint state holds")
    step2_weights = seen_by(tmp_path, 2)[0]["fsdp_weights_at_step2"]
    for seen in seen_by(tmp_path, 2):
        del seen["refused"], seen["fsdp_weights_at_step2"]
        assert seen == {
            "first_committed": True,
            "step2_before_next_save": False,
            "step2_after_next_save": True,
        }
    # keep 2: step 1 pruned; every rank's shard is listed with its checksum.
    assert [info.step for info in runtime.valid_checkpoints(folder)] == [3, 2]
    metadata = json.loads((folder / "step-000003" / "metadata.json").read_text())
    assert metadata["format"] == "dcp" and {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(
        metadata["files"]
    )
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]

    # Reshard 2 -> 1: this process, without torch.distributed, into plain tensors.
    one = checkpoints_into_plain()
    loaded = ShardedCheckpointer(folder, keep=2).load_latest(one)
    assert loaded is not None and loaded.step == 3 and one["step"] == 3
    assert torch.equal(one["model"]["w"], FULL + 100.0) and torch.equal(
        one["model"]["b"], torch.arange(5.0) + 100
    )
    # ... and whole, with no state dict to load into (an evaluation's way).
    whole = checkpoints.load_latest_checkpoint(folder)
    assert whole is not None and whole.step == 3 and torch.equal(whole.state["model"]["w"], FULL + 100.0)
    assert (whole.state["step"], whole.state["config"]) == (3, {"dim": 3, "names": ["a"]})

    # Step 2 was staged before the training step changed the state: it holds the old values.
    checkpoints_corrupt(folder / "step-000003" / "__1_0.distcp")
    two = checkpoints_into_plain()
    loaded = ShardedCheckpointer(folder, keep=2).load_latest(two)
    assert loaded is not None and loaded.step == 2 and two["step"] == 2
    assert torch.equal(two["model"]["w"], FULL) and torch.equal(two["model"]["b"], torch.arange(5.0))

    # Reshard 2 -> 4 (rank 0 skips the corrupted step 3 for every rank), then SIGKILL every rank
    # while step 4 is written: step 2 still loads.
    assert run_ranks(_load_resharded_then_die, 4, tmp_path) == [-signal.SIGKILL] * 4
    for seen in seen_by(tmp_path, 4):
        assert seen.pop("fsdp_weights") == step2_weights  # FSDP2 over 2 ranks, resumed over 4
        assert seen == {
            "step": 2,
            "shard_matches": True,
            "bias": [0.0, 1.0, 2.0, 3.0, 4.0],
            "plain": [2, {"dim": 3, "names": ["a"]}],
        }
    assert (folder / ".tmp-step-000004-sharded").exists() and not (folder / "step-000004").exists()
    after_kill = checkpoints_into_plain()
    loaded = ShardedCheckpointer(folder, keep=2).load_latest(after_kill)
    assert loaded is not None and loaded.step == 2 and torch.equal(after_kill["model"]["w"], FULL)
    # The next save removes what the killed one left (and keeps 2: pruning checks sizes, not
    # checksums, so the corrupted step 3 counts and step 2 goes).
    ShardedCheckpointer(folder, keep=2).save(after_kill, 5, async_mode=None)
    assert sorted(p.name for p in folder.iterdir()) == ["step-000003", "step-000005"]


def checkpoints_into_plain() -> dict[str, Any]:
    return {
        "model": {"w": torch.zeros(ROWS, 3), "b": torch.zeros(5)},
        "step": 0,
        "config": {"dim": 0, "names": []},
    }


def checkpoints_corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert checkpoints.saved_checkpoint(path.parent) is not None  # same size: only the checksum tells


def test_a_sharded_save_that_does_not_fit_is_explained_and_the_last_step_still_loads(tmp_path: Path) -> None:
    with mounted_tmpfs(tmp_path / "fs", 4 * MiB) as small_fs:
        folder = small_fs / "checkpoints"
        saver = ShardedCheckpointer(folder, keep=3)
        saver.save({"w": torch.zeros(4)}, 1, async_mode=None)
        filler = fill(small_fs)
        expected = f"no space left writing {folder / 'step-000002'}: .*TUNEPOD_KEEP_CHECKPOINTS, now 3"
        with pytest.raises(DiskFullError, match=expected):
            saver.save({"w": torch.ones(MiB)}, 2, async_mode="thread")  # raised where it is waited for
            saver.wait()
        assert sorted(p.name for p in folder.iterdir()) == ["step-000001"]  # nothing half written
        into = {"w": torch.ones(4)}
        loaded = saver.load_latest(into)
        assert loaded is not None and loaded.step == 1 and torch.equal(into["w"], torch.zeros(4))
        filler.unlink()
        saver.save({"w": torch.ones(4)}, 2, async_mode=None)
        assert [info.step for info in runtime.valid_checkpoints(folder)] == [2, 1]
