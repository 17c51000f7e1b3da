"""tunepod.runtime: the environment contract, reports, the result file and checkpoints, on real files."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tunepod import runtime, world
from tunepod.runtime import checkpoints
from tunepod.runtime.contract import read_contract
from tunepod.tracking.mirror import ModelPlan, intact_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment an orchestrator hands a job whose folders are all under ``tmp_path``."""
    env = {
        runtime.PARAMS_ENV: json.dumps({"lr": 0.1}),
        runtime.DATA_DIR_ENV: str(tmp_path / "data"),
        runtime.CHECKPOINT_DIR_ENV: str(tmp_path / "checkpoints"),
        runtime.RESULT_FILE_ENV: str(tmp_path / "result.json"),
        runtime.METRICS_FILE_ENV: str(tmp_path / "metrics.jsonl"),
        runtime.TRIAL_ENV: "7",
    }
    return {**env, **extra}


def context(tmp_path: Path, rank: int = 0, **extra: str) -> runtime.TrainingContext:
    return runtime.init(environ=job_env(tmp_path, RANK=str(rank), WORLD_SIZE="2", **extra))


# ---------------------------------------------------------------------------------------------- import


def test_runtime_imports_with_the_standard_library_only() -> None:
    # -S leaves site-packages off sys.path: torch, numpy and mlflow cannot even be found.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import tunepod.runtime;"
        "third = sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names) - {'tunepod'});"
        "assert third == ['__main__'], third"
    )
    subprocess.run([sys.executable, "-S", "-c", code, str(REPO_ROOT)], check=True)


def test_runtime_import_pulls_in_no_installed_third_party_module() -> None:
    # With site-packages available, importing the runtime must still not load torch or mlflow.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); before = set(sys.modules); import tunepod.runtime;"
        "print(' '.join({m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(REPO_ROOT)], check=True, capture_output=True, text=True
    )
    assert done.stdout.split() == ["tunepod"]


def test_pickle_checkpoints_work_without_torch(tmp_path: Path) -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from tunepod import runtime;"
        "ctx = runtime.init({'epochs': 2});"
        "ctx.save_checkpoint({'weights': [1.0, 2.0]}, 0);"
        "print(ctx.load_latest_checkpoint().state['weights'])"
    )
    env = {"PATH": os.environ.get("PATH", ""), **job_env(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, str(REPO_ROOT)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.stdout.strip() == "[1.0, 2.0]"
    metadata = json.loads((tmp_path / "checkpoints" / "step-000000" / "metadata.json").read_text())
    assert metadata["format"] == "pickle"


# ---------------------------------------------------------------------------------------------- contract


def test_outside_a_job_params_come_from_defaults_and_folders_from_cwd(tmp_path: Path) -> None:
    contract = read_contract({}, defaults={"lr": 0.01, "epochs": 3}, cwd=tmp_path)
    local = tmp_path / ".tunepod" / "local"
    assert contract.source == "local"
    assert contract.params == {"lr": 0.01, "epochs": 3}
    assert (contract.data_dir, contract.checkpoint_dir) == (local / "data", local / "checkpoints")
    assert (contract.metrics_file, contract.result_file) == (local / "metrics.jsonl", local / "result.json")
    assert (contract.rank, contract.local_rank, contract.world_size) == (0, 0, 1)
    assert (contract.trial, contract.mlflow_run_id, contract.keep_checkpoints) == (None, None, 3)


def test_tunepod_variables_override_defaults(tmp_path: Path) -> None:
    env = job_env(
        tmp_path,
        RANK="3",
        LOCAL_RANK="1",
        WORLD_SIZE="4",
        TUNEPOD_KEEP_CHECKPOINTS="5",
        MLFLOW_TRACKING_URI="sqlite:///m.db",
        MLFLOW_RUN_ID="abc123",
    )
    ctx = runtime.init({"lr": 0.5, "epochs": 3}, environ=env)
    assert ctx.source == "tunepod"
    assert ctx.params == {"lr": 0.1, "epochs": 3}
    assert (ctx.data_dir, ctx.checkpoint_dir) == (tmp_path / "data", tmp_path / "checkpoints")
    assert (ctx.metrics_file, ctx.result_file) == (tmp_path / "metrics.jsonl", tmp_path / "result.json")
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.is_main) == (3, 1, 4, False)
    assert (ctx.trial, ctx.keep_checkpoints) == ("7", 5)
    assert (ctx.mlflow_tracking_uri, ctx.mlflow_run_id) == ("sqlite:///m.db", "abc123")


def test_init_reads_the_process_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in job_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    assert runtime.init().checkpoint_dir == tmp_path / "checkpoints"


def test_params_alone_still_make_a_local_run(tmp_path: Path) -> None:
    contract = read_contract({runtime.PARAMS_ENV: '{"epochs": 1}'}, cwd=tmp_path)
    assert (contract.source, contract.params) == ("local", {"epochs": 1})


def test_sagemaker_names_are_the_fallback() -> None:
    env = {
        "SM_HPS": '{"lr": 0.2}',
        "SM_CHANNEL_TRAIN": "/opt/ml/input/data/train",
        "TRAINING_JOB_NAME": "job-1",
    }
    contract = read_contract(env)
    assert contract.source == "sagemaker"
    assert contract.params == {"lr": 0.2}
    assert contract.data_dir == Path("/opt/ml/input/data/train")
    assert contract.checkpoint_dir == Path("/opt/ml/checkpoints")
    assert contract.result_file.parent == contract.metrics_file.parent == Path("/opt/ml/output/data")
    assert contract.trial == "job-1"


def test_sagemaker_output_folder_comes_from_the_toolkit_when_it_names_one() -> None:
    contract = read_contract({"SM_HPS": "{}", "SM_OUTPUT_DATA_DIR": "/data/out"})
    assert contract.result_file == Path("/data/out/result.json")
    assert contract.metrics_file == Path("/data/out/metrics.jsonl")


def test_sagemaker_without_a_train_channel_uses_the_first_channel() -> None:
    contract = read_contract({"SM_CHANNEL_VALID": "/v", "SM_CHANNEL_DIGITS": "/d"})
    assert contract.data_dir == Path("/d")


def test_tunepod_variables_win_over_sagemaker_ones(tmp_path: Path) -> None:
    contract = read_contract({**job_env(tmp_path), "SM_HPS": '{"lr": 9}', "SM_CHANNEL_TRAIN": "/x"})
    assert (contract.params, contract.data_dir) == ({"lr": 0.1}, tmp_path / "data")


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("TUNEPOD_PARAMS", "{lr: 1}", "TUNEPOD_PARAMS is not valid JSON"),
        ("TUNEPOD_PARAMS", "[1, 2]", "TUNEPOD_PARAMS must be a JSON object"),
        ("SM_HPS", "nope", "SM_HPS is not valid JSON"),
        ("RANK", "one", "RANK must be an integer"),
        ("WORLD_SIZE", "0", "WORLD_SIZE must be >= 1"),
        ("TUNEPOD_KEEP_CHECKPOINTS", "0", "TUNEPOD_KEEP_CHECKPOINTS must be >= 1"),
    ],
)
def test_a_malformed_variable_is_named(name: str, value: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        read_contract({name: value})


# ---------------------------------------------------------------------------------------------- reports


def test_rank_zero_appends_one_json_line_per_report(tmp_path: Path) -> None:
    ctx = context(tmp_path)
    ctx.report(0, val_accuracy=0.5, train_loss=2)
    ctx.report(1, val_accuracy=np.float32(0.75))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["metrics"] for line in lines] == [
        {"val_accuracy": 0.5, "train_loss": 2.0},
        {"val_accuracy": 0.75},
    ]
    reports = runtime.read_reports(tmp_path / "metrics.jsonl")
    assert [(r.step, r.metrics["val_accuracy"]) for r in reports] == [(0, 0.5), (1, 0.75)]
    assert all(isinstance(r.time, float) and r.time > 0 for r in reports)


def test_other_ranks_write_nothing_but_their_heartbeat(tmp_path: Path) -> None:
    ctx = context(tmp_path, rank=1)
    ctx.report(0, val_accuracy=0.5)
    assert ctx.save_checkpoint({"w": torch.ones(2)}, 0) is None
    ctx.finish(val_accuracy=0.5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["progress"]
    assert sorted(p.name for p in (tmp_path / "progress").iterdir()) == ["rank-1.json"]


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (math.nan, ValueError, "'loss' is nan"),
        (math.inf, ValueError, "'loss' is inf"),
        ("0.5", TypeError, "'loss' must be a real number, got str"),
        (True, TypeError, "got bool"),
        (torch.tensor(0.5), TypeError, "tensor.item()"),
    ],
)
def test_a_bad_metric_is_rejected_and_not_written(
    tmp_path: Path, value: object, error: type, message: str
) -> None:
    ctx = context(tmp_path)
    with pytest.raises(error, match=re.escape(message)):
        ctx.report(0, loss=value)  # type: ignore[arg-type]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("step", [-1, 1.5, "2"])
def test_a_bad_step_is_rejected(tmp_path: Path, step: object) -> None:
    with pytest.raises((TypeError, ValueError), match="step"):
        context(tmp_path).report(step, loss=1.0)  # type: ignore[arg-type]


def test_a_report_needs_at_least_one_metric(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no metrics"):
        context(tmp_path).report(0)


def test_read_reports_tolerates_a_torn_last_line(tmp_path: Path) -> None:
    metrics_file = tmp_path / "metrics.jsonl"
    context(tmp_path).report(0, loss=1.0)
    with open(metrics_file, "a") as handle:
        handle.write('{"step": 1, "metrics": {"loss": 0.')  # a writer caught mid-line
    assert [r.step for r in runtime.read_reports(metrics_file)] == [0]


def test_a_report_after_a_torn_line_starts_its_own_line(tmp_path: Path) -> None:
    # A job killed mid-write and resumed: the torn line must not swallow the next report.
    metrics_file = tmp_path / "metrics.jsonl"
    metrics_file.write_text('{"step": 0, "metrics": {"loss": 1.0}, "time": 1.0}\n{"step": 1, "metr')
    context(tmp_path).report(1, loss=0.5)
    assert [(r.step, r.metrics) for r in runtime.read_reports(metrics_file)] == [
        (0, {"loss": 1.0}),
        (1, {"loss": 0.5}),
    ]


def test_read_reports_of_a_missing_file_is_empty(tmp_path: Path) -> None:
    assert runtime.read_reports(tmp_path / "absent.jsonl") == []


# ---------------------------------------------------------------------------------------------- result


def test_finish_writes_the_result_with_the_last_reported_step(tmp_path: Path) -> None:
    ctx = context(tmp_path)
    ctx.report(0, val_accuracy=0.5)
    ctx.report(1, val_accuracy=0.6)
    ctx.finish(val_accuracy=0.6)
    result = runtime.read_result(tmp_path / "result.json")
    assert result is not None
    assert (result.metrics, result.step) == ({"val_accuracy": 0.6}, 1)
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["metrics.jsonl", "progress", "result.json"]  # no temp file left


def test_finish_after_a_resume_takes_the_step_from_the_metrics_file(tmp_path: Path) -> None:
    context(tmp_path).report(4, val_accuracy=0.9)
    resumed = context(tmp_path)  # a new process that had nothing left to train
    resumed.finish(val_accuracy=0.9)
    result = runtime.read_result(tmp_path / "result.json")
    assert result is not None and result.step == 4


def test_finish_without_any_report_has_no_step(tmp_path: Path) -> None:
    context(tmp_path).finish(test_accuracy=0.8)
    result = runtime.read_result(tmp_path / "result.json")
    assert result is not None and result.step is None


def test_a_rejected_result_leaves_the_previous_one_whole(tmp_path: Path) -> None:
    ctx = context(tmp_path)
    ctx.finish(val_accuracy=0.7)
    before = (tmp_path / "result.json").read_bytes()
    with pytest.raises(ValueError):
        ctx.finish(val_accuracy=math.nan)
    assert (tmp_path / "result.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["progress", "result.json"]


def test_the_result_file_replaces_the_old_one_by_rename(tmp_path: Path) -> None:
    # Atomic replacement: a reader holding the old file keeps reading the old, whole content.
    ctx = context(tmp_path)
    ctx.finish(val_accuracy=0.7)
    with open(tmp_path / "result.json") as old:
        ctx.finish(val_accuracy=0.8)
        assert json.load(old)["metrics"] == {"val_accuracy": 0.7}
    result = runtime.read_result(tmp_path / "result.json")
    assert result is not None and result.metrics == {"val_accuracy": 0.8}


def test_read_result_is_none_until_written_and_rejects_garbage(tmp_path: Path) -> None:
    assert runtime.read_result(tmp_path / "result.json") is None
    (tmp_path / "result.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"result\.json is not a tunepod result"):
        runtime.read_result(tmp_path / "result.json")


# ---------------------------------------------------------------------------------------------- checkpoints


def test_a_checkpoint_is_a_step_folder_with_state_and_metadata(tmp_path: Path) -> None:
    ctx = context(tmp_path)
    folder = ctx.save_checkpoint({"weights": torch.arange(4.0), "epoch": 7}, step=7)
    assert folder == tmp_path / "checkpoints" / "step-000007"
    assert sorted(p.name for p in folder.iterdir()) == ["metadata.json", "state.pt"]
    metadata = json.loads((folder / "metadata.json").read_text())
    state_bytes = (folder / "state.pt").read_bytes()
    assert metadata["step"] == 7 and metadata["format"] == "torch" and metadata["size"] == len(state_bytes)
    assert metadata["sha256"] == hashlib.sha256(state_bytes).hexdigest()
    loaded = ctx.load_latest_checkpoint()
    assert loaded is not None and (loaded.step, loaded.path, loaded.state["epoch"]) == (7, folder, 7)
    assert torch.equal(loaded.state["weights"], torch.arange(4.0))


def test_bytes_are_pickled(tmp_path: Path) -> None:
    ctx = context(tmp_path)
    folder = ctx.save_checkpoint(b"\x00raw", step=0)
    assert folder is not None and json.loads((folder / "metadata.json").read_text())["format"] == "pickle"
    loaded = ctx.load_latest_checkpoint()
    assert loaded is not None and loaded.state == b"\x00raw"


def test_no_checkpoint_yet(tmp_path: Path) -> None:
    assert context(tmp_path).load_latest_checkpoint() is None
    assert runtime.latest_checkpoint(tmp_path / "checkpoints") is None


def test_a_leftover_temp_folder_and_a_folder_without_metadata_are_ignored(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ctx = context(tmp_path)
    ctx.save_checkpoint({"epoch": 1}, step=1)
    checkpoint_dir = tmp_path / "checkpoints"
    # A save killed before its rename: a whole, newer, but hidden folder.
    shutil.copytree(checkpoint_dir / "step-000001", checkpoint_dir / ".tmp-step-000003-123-abcd")
    # A step folder whose metadata.json was never written.
    incomplete = checkpoint_dir / "step-000002"
    incomplete.mkdir()
    (incomplete / "state.pt").write_bytes(b"half")

    loaded = ctx.load_latest_checkpoint()
    assert loaded is not None and (loaded.step, loaded.state) == (1, {"epoch": 1})
    err = capfd.readouterr().err
    assert f"skipping checkpoint {incomplete}: no metadata.json" in err
    assert ".tmp-step" not in err  # hidden folders are never candidates
    info = runtime.latest_checkpoint(checkpoint_dir)
    assert info is not None and (info.step, info.path) == (1, checkpoint_dir / "step-000001")


def corrupt(state_file: Path) -> None:
    """Flip one byte in the middle: same size, different content."""
    data = bytearray(state_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state_file.write_bytes(bytes(data))


def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ctx = context(tmp_path)
    ctx.save_checkpoint({"w": torch.zeros(3)}, step=1)
    ctx.save_checkpoint({"w": torch.ones(3)}, step=2)
    newest = tmp_path / "checkpoints" / "step-000002"
    corrupt(newest / "state.pt")

    loaded = ctx.load_latest_checkpoint()
    assert loaded is not None and loaded.step == 1 and torch.equal(loaded.state["w"], torch.zeros(3))
    assert f"skipping checkpoint {newest}: state.pt does not match the sha256" in capfd.readouterr().err
    info = runtime.latest_checkpoint(tmp_path / "checkpoints")
    assert info is not None and info.step == 1


def test_a_truncated_state_file_is_skipped(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    ctx = context(tmp_path)
    ctx.save_checkpoint(b"older", step=0)
    folder = ctx.save_checkpoint(b"newer", step=1)
    assert folder is not None
    (folder / "state.pt").write_bytes(b"")
    loaded = ctx.load_latest_checkpoint()
    assert loaded is not None and loaded.state == b"older"
    assert "state.pt has 0 bytes" in capfd.readouterr().err


def test_the_sha256_hashed_while_writing_is_that_of_the_file_written(tmp_path: Path) -> None:
    # Several MB each: torch writes a large storage in large writes, pickle a large bytes object in one.
    ctx = context(tmp_path)
    states = {0: {"w": torch.randn(2_000_000), "b": torch.arange(5)}, 1: os.urandom(3_000_000)}
    for step, state in states.items():
        folder = ctx.save_checkpoint(state, step)
        assert folder is not None
        metadata = json.loads((folder / "metadata.json").read_text())
        assert metadata["sha256"] == hashlib.sha256((folder / "state.pt").read_bytes()).hexdigest()


def test_the_saved_steps_are_listed_from_their_metadata_and_verified_where_loaded(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    ctx = context(tmp_path, TUNEPOD_KEEP_CHECKPOINTS="4")
    for step in range(4):
        ctx.save_checkpoint(b"x" * 1000, step)
    folders = tmp_path / "checkpoints"
    corrupt(folders / "step-000003" / "state.pt")  # same size: only its sha256 tells
    (folders / "step-000002" / "state.pt").write_bytes(b"")  # its size tells

    # The orchestrator's list trusts the metadata and the size: the corrupted step 3 is on it.
    assert [info.step for info in checkpoints.saved_checkpoints(folders)] == [3, 1, 0]
    # What loads a step verifies it, from the step asked for down.
    found = checkpoints.verified_checkpoint(folders, 3)
    assert found is not None and found.step == 1
    err = capfd.readouterr().err
    assert "step-000003: state.pt does not match the sha256" in err and "step-000002: state.pt has 0" in err
    found = checkpoints.verified_checkpoint(folders, 0)
    assert found is not None and found.step == 0
    corrupt(folders / "step-000000" / "state.pt")
    assert checkpoints.verified_checkpoint(folders, 0) is None


def test_the_model_logged_is_an_intact_checkpoint(tmp_path: Path) -> None:
    ctx = context(tmp_path)
    for step in range(3):
        ctx.save_checkpoint({"step": step}, step)
    folders = tmp_path / "checkpoints"
    plan = ModelPlan(folders / "step-000002", name="m", step=2, params={"lr": 0.1})
    assert intact_model(plan) == plan
    corrupt(folders / "step-000002" / "state.pt")
    assert intact_model(plan) == ModelPlan(folders / "step-000001", name="m", step=1, params={"lr": 0.1})
    for step in (0, 1):
        corrupt(folders / f"step-{step:06d}" / "state.pt")
    assert intact_model(plan) is None


def test_only_the_newest_k_valid_steps_and_no_temp_folder_are_kept(tmp_path: Path) -> None:
    ctx = context(tmp_path, TUNEPOD_KEEP_CHECKPOINTS="2")
    stale = tmp_path / "checkpoints" / ".tmp-step-000000-99-dead"
    stale.mkdir(parents=True)
    for step in range(5):
        ctx.save_checkpoint({"step": step}, step)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000003", "step-000004"]
    assert [info.step for info in runtime.valid_checkpoints(tmp_path / "checkpoints")] == [4, 3]


def test_a_corrupted_step_does_not_count_towards_the_kept_ones(tmp_path: Path) -> None:
    ctx = context(tmp_path, TUNEPOD_KEEP_CHECKPOINTS="2")
    for step in range(3):
        ctx.save_checkpoint(b"x" * (step + 1), step)
    (tmp_path / "checkpoints" / "step-000002" / "state.pt").write_bytes(b"")
    ctx.save_checkpoint(b"four", 3)
    # Valid: 3 and 1 are the two newest; the broken 2 stays (a resumed job overwrites it), 0 goes.
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000001", "step-000002", "step-000003"]


def test_saving_an_existing_step_replaces_it(tmp_path: Path) -> None:
    ctx = context(tmp_path)
    ctx.save_checkpoint({"try": 1}, step=5)
    ctx.save_checkpoint({"try": 2}, step=5)
    loaded = ctx.load_latest_checkpoint()
    assert loaded is not None and loaded.state == {"try": 2}
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000005"]


def test_state_is_loaded_with_weights_only(tmp_path: Path) -> None:
    # An arbitrary object would run code on unpickling; weights_only refuses it. Saving one is
    # refused (below), so this step is written by hand, as something other than tunepod could.
    folder = tmp_path / "checkpoints" / "step-000000"
    folder.mkdir(parents=True)
    torch.save({"path": Path("/x")}, folder / "state.pt")
    write_metadata(folder, 0, "torch")
    with pytest.raises(Exception, match="weights_only"):
        context(tmp_path).load_latest_checkpoint()


def one_process(tmp_path: Path) -> runtime.TrainingContext:
    """A job of one process: sharded saves need torch.distributed only with more."""
    return runtime.init(environ=job_env(tmp_path))


def test_a_sharded_save_of_many_processes_needs_torch_distributed(tmp_path: Path) -> None:
    with pytest.raises(
        RuntimeError, match=r"job of 2 processes needs torch.distributed: fix: call .*init_process_group"
    ):
        context(tmp_path).save_checkpoint({"w": torch.zeros(2)}, step=0, sharded=True)
    assert not (tmp_path / "checkpoints").exists()


def write_metadata(folder: Path, step: int, state_format: str) -> None:
    """The metadata.json a writer of the shared folder can forge for ``folder/state.pt``."""
    data = (folder / "state.pt").read_bytes()
    metadata = {"step": step, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (folder / "metadata.json").write_text(json.dumps({**metadata, "format": state_format, "time": 0.0}))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_state_the_loader_would_refuse_is_refused_at_save(tmp_path: Path, sharded: bool) -> None:
    ctx = one_process(tmp_path)
    ctx.save_checkpoint({"w": torch.zeros(2)}, step=0, sharded=sharded)
    rng = np.random.default_rng(0)
    state = {"w": torch.ones(2), "numpy_rng": np.random.get_state(), "bit_generator": rng.bit_generator}
    with pytest.raises(
        checkpoints.CheckpointStateError, match=r"numpy\.ndarray.*fix: convert them"
    ) as refused:
        ctx.save_checkpoint(state, step=1, sharded=sharded)
    assert "add_safe_globals" in str(refused.value)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000000"]  # nothing left behind
    loaded = ctx.load_latest_checkpoint(into={"w": torch.zeros(2)} if sharded else None)
    assert loaded is not None and loaded.step == 0


def test_a_pickle_state_with_objects_is_refused_at_save(tmp_path: Path) -> None:
    # Without torch the state is pickled; its loader takes no classes, so neither does the save.
    code = (
        "import sys, datetime; sys.path.insert(0, sys.argv[1]); from tunepod import runtime;"
        "ctx = runtime.init();"
        "ctx.save_checkpoint({'day': datetime.date(2026, 1, 1)}, 0)"
    )
    env = {"PATH": os.environ.get("PATH", ""), **job_env(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, str(REPO_ROOT)], capture_output=True, text=True, env=env
    )
    assert done.returncode != 0
    assert "CheckpointStateError: the checkpoint state holds objects" in done.stderr
    assert "datetime.date" in done.stderr
    assert list((tmp_path / "checkpoints").iterdir()) == []


class RunsCode:
    """What a writer of the shared folder could plant: unpickling it calls ``exec``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_a_crafted_pickle_checkpoint_runs_no_code_on_load(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    folder = tmp_path / "checkpoints" / "step-000003"
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(pickle.dumps({"weights": RunsCode(marker)}))
    write_metadata(folder, 3, "pickle")
    with pytest.raises(
        checkpoints.UnsafeCheckpointError, match=r"names builtins\.exec: loading it would run code"
    ):
        context(tmp_path).load_latest_checkpoint()
    assert not marker.exists()


def test_a_crafted_sharded_checkpoint_runs_no_code_on_load(tmp_path: Path) -> None:
    # DCP's own reader unpickles .metadata as it comes; a forged one must not run.
    ctx = one_process(tmp_path)
    folder = ctx.save_checkpoint({"w": torch.zeros(2)}, step=4, sharded=True)
    assert folder is not None
    marker = tmp_path / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    metadata = json.loads((folder / "metadata.json").read_text())
    data = (folder / ".metadata").read_bytes()
    metadata["files"][".metadata"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (folder / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(
        checkpoints.UnsafeCheckpointError, match=r"names builtins\.exec, which is not part of DCP"
    ):
        ctx.load_latest_checkpoint(into={"w": torch.zeros(2)})
    assert not marker.exists()


def test_a_sharded_step_loads_whole_without_a_state_dict(tmp_path: Path) -> None:
    # An evaluation builds its model from the config in the state, so it cannot hand a template.
    ctx = one_process(tmp_path)
    state = {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "model_config": {"dim": 3, "names": ["a", "b"]},
        "step": 1,
    }
    ctx.save_checkpoint(state, step=1, sharded=True)
    loaded = ctx.load_latest_checkpoint()
    assert loaded is not None and loaded.step == 1
    whole = loaded.state
    assert torch.equal(whole["model"]["w"], state["model"]["w"]) and torch.equal(
        whole["model"]["b"], torch.ones(2)
    )
    assert whole["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert torch.equal(whole["optimizer"]["state"]["0"]["step"], torch.tensor(3.0))  # DCP keys are strings
    assert (whole["model_config"], whole["step"]) == ({"dim": 3, "names": ["a", "b"]}, 1)


def test_async_save_needs_a_sharded_save_and_a_known_mode(tmp_path: Path) -> None:
    ctx = context(tmp_path)
    with pytest.raises(ValueError, match="async_save needs sharded=True"):
        ctx.save_checkpoint({"w": torch.zeros(2)}, step=1, async_save=True)
    with pytest.raises(ValueError, match=r"async_save='later'; valid: False, True, 'thread', 'process'"):
        ctx.save_checkpoint({"w": torch.zeros(2)}, step=1, sharded=True, async_save="later")


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep must be >= 1"):
        checkpoints.prune_checkpoints(tmp_path, keep=0)


def test_the_newest_step_is_copied_whole_once_and_a_folder_without_one_gives_none(tmp_path: Path) -> None:
    """How PBT seeds a continuation: the donor's newest intact step, copied under the same name and
    verified; a second call returns the copy already there, even after the donor saved a newer step."""
    donor, seed = tmp_path / "donor", tmp_path / "seed"
    for step in (3, 4):
        checkpoints.save_checkpoint(donor, {"step": step}, step, keep=2)
    (donor / "step-000005").mkdir()  # a save without metadata: not a step
    copied = checkpoints.copy_newest_checkpoint(donor, seed)
    assert copied is not None and copied.step == 4 and copied.path == seed / "step-000004"
    assert checkpoints.load_latest_checkpoint(seed).state == {"step": 4}  # type: ignore[union-attr]
    checkpoints.save_checkpoint(donor, {"step": 6}, 6, keep=2)
    again = checkpoints.copy_newest_checkpoint(donor, seed)
    assert again is not None and again.step == 4
    assert [p.name for p in seed.iterdir()] == ["step-000004"]  # nothing hidden left behind
    assert checkpoints.copy_newest_checkpoint(tmp_path / "empty", tmp_path / "nothing") is None


def test_a_step_pruned_by_its_job_mid_copy_is_given_up_for_the_then_newest_one(tmp_path: Path) -> None:
    """PBT copies a running donor's newest step while the donor's rank 0 goes on saving and pruning.
    Here the prune lands, through the real save, between the copy listing the step's files and copying
    the first one (each file is copied through ``world.copy_file``, the seam where the simulation lets
    a donor run): ``copytree`` then fails on every file of the step (``shutil.Error``), which is the
    step gone, not a broken copy; the copy takes the donor's newest step instead."""
    donor, seed = tmp_path / "donor", tmp_path / "seed"
    checkpoints.save_checkpoint(donor, {"step": 1}, 1, keep=1)
    saved_mid_copy: list[int] = []

    class DonorSavesMidCopy(world.RealWorld):
        def copy_file(self, source: str, target: str) -> object:
            if not saved_mid_copy:
                saved_mid_copy.append(2)
                checkpoints.save_checkpoint(donor, {"step": 2}, 2, keep=1)  # prunes step 1, being copied
            return super().copy_file(source, target)

    with world.installed(DonorSavesMidCopy()):
        copied = checkpoints.copy_newest_checkpoint(donor, seed)
    assert saved_mid_copy == [2]
    assert copied is not None and copied.step == 2
    assert checkpoints.load_latest_checkpoint(seed).state == {"step": 2}  # type: ignore[union-attr]
    assert [p.name for p in seed.iterdir()] == ["step-000002"]  # the lost copy left nothing behind


def test_copies_of_a_donor_that_saves_and_prunes_meanwhile_never_fail(tmp_path: Path) -> None:
    """The same race for real: a thread saves a step after another through the real save (which keeps
    one), while copies of the newest step run one after another. Each copy is a whole, verified step,
    or None where three steps in a row were pruned under it; none raises."""
    donor = tmp_path / "donor"
    size = 1 << 20  # a copy of a MiB takes long enough for a save to prune the step under it
    checkpoints.save_checkpoint(donor, b"\0" * size, 0, keep=1)
    done = threading.Event()

    def save_and_prune() -> None:
        step = 1
        while not done.is_set():
            checkpoints.save_checkpoint(donor, bytes([step % 256]) * size, step, keep=1)
            step += 1

    saver = threading.Thread(target=save_and_prune)
    saver.start()
    try:
        copies = [checkpoints.copy_newest_checkpoint(donor, tmp_path / f"seed-{n}") for n in range(60)]
    finally:
        done.set()
        saver.join()
    for copied in copies:
        if copied is not None:
            assert checkpoints.verified_checkpoint(copied.path.parent, copied.step) == copied


def test_two_copies_into_one_folder_at_once_both_return_one_whole_step(tmp_path: Path) -> None:
    """Two drivers of one trial (a stale one beside its lease's new holder) seed one continuation
    folder at once. Each copy clears the folder's hidden leftovers first, so without taking turns the
    second deleted the first's copy in progress, which then failed with its source intact. Real
    threads, each file's copy slowed so that the two overlap."""
    donor, seed = tmp_path / "donor", tmp_path / "seed"
    checkpoints.save_checkpoint(donor, b"\0" * 1024, 3, keep=1)
    first_copying = threading.Event()

    class SlowCopies(world.RealWorld):
        def copy_file(self, source: str, target: str) -> object:
            first_copying.set()
            time.sleep(0.3)
            return super().copy_file(source, target)

    results: list[object] = []

    def copy() -> None:
        try:
            with world.installed(SlowCopies()):  # a world is installed per thread
                results.append(checkpoints.copy_newest_checkpoint(donor, seed))
        except Exception as failed:  # the failure is what the test reports
            results.append(failed)

    first = threading.Thread(target=copy)
    first.start()
    assert first_copying.wait(10)
    second = threading.Thread(target=copy)
    second.start()
    first.join()
    second.join()
    assert all(isinstance(r, checkpoints.CheckpointInfo) and r.step == 3 for r in results), results
    assert [p.name for p in seed.iterdir()] == ["step-000003"]
