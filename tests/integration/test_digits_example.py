"""examples/digits under real torchrun (2 processes, DDP over gloo): train, determinism, kill and resume,
a corrupted checkpoint, evaluate. Every job talks to the test only through the tunepod.runtime contract."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tunepod import runtime
from tunepod.staging.builtin import write_digits

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAIN = REPO_ROOT / "examples" / "digits" / "train.py"
EVALUATE = REPO_ROOT / "examples" / "digits" / "evaluate.py"
EPOCHS = 4
PARAMS = {"lr": 0.01, "hidden": 64, "optimizer": "adam", "epochs": EPOCHS, "seed": 0}
# A guard against a hung job, not a speed expectation: a run takes a few seconds.
JOB_DEADLINE_S = 180


@dataclass(frozen=True)
class Job:
    """The files of one job, named as the orchestrator would hand them over."""

    root: Path
    checkpoint_dir: Path

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def result(self) -> Path:
        return self.root / "result.json"

    @property
    def log(self) -> Path:
        return self.root / "output.log"

    def env(self, data_dir: Path, params: dict[str, object]) -> dict[str, str]:
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("TUNEPOD_", "SM_", "MLFLOW_"))}
        pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        return {
            **inherited,
            "PYTHONPATH": pythonpath,
            "OMP_NUM_THREADS": "1",
            runtime.PARAMS_ENV: json.dumps(params),
            runtime.DATA_DIR_ENV: str(data_dir),
            runtime.CHECKPOINT_DIR_ENV: str(self.checkpoint_dir),
            runtime.METRICS_FILE_ENV: str(self.metrics),
            runtime.RESULT_FILE_ENV: str(self.result),
            runtime.TRIAL_ENV: self.root.name,
        }

    def reports(self) -> list[runtime.Report]:
        return runtime.read_reports(self.metrics)

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


def new_job(root: Path, checkpoint_dir: Path | None = None) -> Job:
    root.mkdir(parents=True, exist_ok=True)
    return Job(root=root, checkpoint_dir=checkpoint_dir or root / "checkpoints")


def torchrun(script: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]


def plain(script: Path) -> list[str]:
    """One process without torchrun, as ``python train.py`` on a laptop."""
    return [sys.executable, str(script)]


def start(job: Job, data_dir: Path, params: dict[str, object], argv: list[str]) -> subprocess.Popen[bytes]:
    with open(job.log, "ab") as log:
        # Its own session, so the test can kill torchrun and its workers together, like a launcher does.
        return subprocess.Popen(
            argv, env=job.env(data_dir, params), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def run(job: Job, data_dir: Path, params: dict[str, object], argv: list[str]) -> int:
    process = start(job, data_dir, params, argv)
    try:
        return process.wait(timeout=JOB_DEADLINE_S)
    finally:
        kill_group(process)


def run_ok(job: Job, data_dir: Path, params: dict[str, object], argv: list[str]) -> None:
    code = run(job, data_dir, params, argv)
    assert code == 0, f"{argv[-1]} exited {code}; last lines of {job.log}:\n{job.log_tail()}"


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL torchrun's whole process group and wait until none of its processes is left."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    process.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)  # orphaned workers linger a moment as zombies before init reaps them
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes of group {process.pid} survived SIGKILL")


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("digits")
    write_digits(folder)
    return folder


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, digits_dir: Path) -> Job:
    job = new_job(tmp_path_factory.mktemp("finished"))
    run_ok(job, digits_dir, PARAMS, torchrun(TRAIN))
    return job


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory, digits_dir: Path) -> Job:
    """A run SIGKILLed (torchrun and workers) once its second checkpoint exists, before its last epoch."""
    job = new_job(tmp_path_factory.mktemp("killed"))
    process = start(job, digits_dir, {**PARAMS, "epoch_sleep_s": 1.5}, torchrun(TRAIN))
    try:
        deadline = time.monotonic() + JOB_DEADLINE_S
        while (latest := runtime.latest_checkpoint(job.checkpoint_dir)) is None or latest.step < 1:
            assert process.poll() is None, f"train.py exited early; last lines:\n{job.log_tail()}"
            assert time.monotonic() < deadline, f"no second checkpoint; last lines:\n{job.log_tail()}"
            time.sleep(0.05)
    finally:
        kill_group(process)
    return job


def resume_copy(killed: Job, root: Path) -> Job:
    """A fresh job folder (new metrics and result files) over a copy of the killed run's checkpoints."""
    job = new_job(root, root / "checkpoints")
    shutil.copytree(killed.checkpoint_dir, job.checkpoint_dir)
    return job


# ---------------------------------------------------------------------------------------------- tests


def test_training_reports_every_epoch_and_writes_a_result(finished: Job) -> None:
    reports = finished.reports()
    assert [r.step for r in reports] == list(range(EPOCHS))
    assert all(set(r.metrics) == {"val_accuracy", "train_loss"} for r in reports)
    assert reports[-1].metrics["val_accuracy"] > 0.8
    result = runtime.read_result(finished.result)
    assert result is not None and result.step == EPOCHS - 1
    assert result.metrics["val_accuracy"] == reports[-1].metrics["val_accuracy"]
    kept = [info.step for info in runtime.valid_checkpoints(finished.checkpoint_dir)]
    assert kept == [3, 2, 1]  # the default keeps the last 3


def test_the_same_seed_gives_the_same_metrics(finished: Job, digits_dir: Path, tmp_path: Path) -> None:
    again = new_job(tmp_path / "again")
    run_ok(again, digits_dir, PARAMS, torchrun(TRAIN))
    assert [(r.step, r.metrics) for r in again.reports()] == [(r.step, r.metrics) for r in finished.reports()]


def test_a_killed_run_resumes_after_its_last_checkpoint(
    killed: Job, finished: Job, digits_dir: Path, tmp_path: Path
) -> None:
    assert runtime.read_result(killed.result) is None  # it really was killed before the end
    last = runtime.latest_checkpoint(killed.checkpoint_dir)
    assert last is not None and last.step < EPOCHS - 1
    resumed = resume_copy(killed, tmp_path / "resumed")
    run_ok(resumed, digits_dir, PARAMS, torchrun(TRAIN))
    reports = resumed.reports()
    assert [r.step for r in reports] == list(range(last.step + 1, EPOCHS))
    assert runtime.read_result(resumed.result) is not None
    # Resuming restores model, optimizer and data order: the metrics match an uninterrupted run.
    assert [r.metrics for r in reports] == [r.metrics for r in finished.reports()][last.step + 1 :]


def test_a_corrupted_newest_checkpoint_resumes_from_the_one_before(
    killed: Job, finished: Job, digits_dir: Path, tmp_path: Path
) -> None:
    job = resume_copy(killed, tmp_path / "corrupted")
    newest = runtime.latest_checkpoint(job.checkpoint_dir)
    assert newest is not None and newest.step >= 1
    state_file = newest.path / "state.pt"
    data = bytearray(state_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state_file.write_bytes(bytes(data))

    run_ok(job, digits_dir, PARAMS, torchrun(TRAIN))
    assert [r.step for r in job.reports()] == list(range(newest.step, EPOCHS))
    assert f"skipping checkpoint {newest.path}" in job.log.read_text()
    assert [r.metrics for r in job.reports()] == [r.metrics for r in finished.reports()][newest.step :]


def test_evaluate_scores_the_latest_checkpoint_on_the_test_split(
    finished: Job, digits_dir: Path, tmp_path: Path
) -> None:
    job = new_job(tmp_path / "evaluate", checkpoint_dir=finished.checkpoint_dir)
    run_ok(job, digits_dir, {}, plain(EVALUATE))
    result = runtime.read_result(job.result)
    assert result is not None and result.metrics["test_accuracy"] > 0.8
    assert str(finished.checkpoint_dir / "step-000003") in job.log.read_text()


def test_evaluate_without_a_checkpoint_says_so(digits_dir: Path, tmp_path: Path) -> None:
    job = new_job(tmp_path / "nothing")
    assert run(job, digits_dir, {}, plain(EVALUATE)) != 0
    assert f"no valid checkpoint in {job.checkpoint_dir}" in job.log.read_text()
    assert runtime.read_result(job.result) is None


def test_train_runs_as_one_plain_process(digits_dir: Path, tmp_path: Path) -> None:
    job = new_job(tmp_path / "plain")
    run_ok(job, digits_dir, {**PARAMS, "epochs": 2}, plain(TRAIN))
    assert [r.step for r in job.reports()] == [0, 1]
    result = runtime.read_result(job.result)
    assert result is not None and result.metrics["val_accuracy"] > 0.8


def test_unknown_params_are_named(digits_dir: Path, tmp_path: Path) -> None:
    job = new_job(tmp_path / "typo")
    assert run(job, digits_dir, {**PARAMS, "learning_rate": 0.1}, plain(TRAIN)) != 0
    assert "unknown params ['learning_rate']" in job.log.read_text()
    assert not job.metrics.exists()
