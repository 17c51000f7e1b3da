"""The LCBench agreement's comparison, and the LCBench training script's refusals (run as a process,
outside a job, as a user runs it by hand)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lcbench.agreement import TRAIN_SCRIPT, TrialSeen, differences

REPO = Path(__file__).resolve().parents[2]


def seen(number: int = 0, outcome: str = "COMPLETE", lr: float = 0.01, **values: float) -> TrialSeen:
    steps = {int(step.removeprefix("e")): value for step, value in values.items()} or {0: 50.0, 1: 60.0}
    return TrialSeen(number, {"learning_rate": lr}, outcome, steps)


def test_runs_that_asked_decided_and_trained_alike_agree() -> None:
    assert differences([seen(0), seen(1, "PRUNED")], [seen(0), seen(1, "PRUNED")]) == []


def test_a_late_epoch_of_the_real_run_is_no_difference() -> None:
    assert differences([seen(e0=50.0, e1=60.0, e2=61.0)], [seen(e0=50.0, e1=60.0)]) == []


@pytest.mark.parametrize(
    ("real", "simulated", "said"),
    [
        ([seen(lr=0.02)], [seen(lr=0.01)], "trial 0 was asked {'learning_rate': 0.02} for real"),
        ([seen(outcome="PRUNED")], [seen()], "trial 0 ended PRUNED for real, COMPLETE simulated"),
        ([seen(e0=50.0)], [seen(e0=50.0, e1=60.0)], "trial 0 never trained epochs [2] for real"),
        (
            [seen(e0=50.0, e1=61.0)],
            [seen(e0=50.0, e1=60.0)],
            "trial 0 epoch 2: 61.0 for real, 60.0 simulated",
        ),
        ([seen(0)], [seen(0), seen(1)], "trials [0] ran for real, [0, 1] simulated"),
    ],
)
def test_every_way_the_runs_differ_is_named(
    real: list[TrialSeen], simulated: list[TrialSeen], said: str
) -> None:
    found = differences(real, simulated)
    assert any(said in difference for difference in found), found


def train(tmp_path: Path, **params: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TUNEPOD_PARAMS": json.dumps(params), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("params", "said"),
    [
        ({"lr": 0.1}, "unknown params ['lr']; valid params: ['batch_size', 'epochs', 'instance'"),
        ({"epochs": 53}, "epochs must be 1-52 (LCBench's curves), got 53"),
        ({"time_scale": -1}, "time_scale must be 0 or more, got -1"),
        ({"instance": "1"}, "unknown LCBench instance '1'; valid: 3945, 7593"),
    ],
)
def test_the_training_script_refuses_bad_params_naming_them(
    tmp_path: Path, params: dict[str, object], said: str
) -> None:
    done = train(tmp_path, **params)
    assert done.returncode != 0
    assert said in done.stderr, done.stderr


def test_the_training_script_reports_each_epoch_of_the_surrogates_curve_and_resumes(tmp_path: Path) -> None:
    from benchmarks.lcbench.problem import shared_surrogate

    config = {
        "batch_size": 64,
        "learning_rate": 0.01,
        "momentum": 0.9,
        "weight_decay": 0.001,
        "num_layers": 2,
        "max_units": 128,
        "max_dropout": 0.2,
    }
    first = train(tmp_path, epochs=2, time_scale=0, **config)
    assert first.returncode == 0, first.stderr
    again = train(tmp_path, epochs=4, time_scale=0, **config)
    assert again.returncode == 0, again.stderr
    assert "at epoch 2" in again.stdout
    lines = (tmp_path / ".tunepod/local/metrics.jsonl").read_text().splitlines()
    reports = [json.loads(line) for line in lines]
    assert [r["step"] for r in reports] == [0, 1, 2, 3]
    curve = shared_surrogate().curve("3945", config).val_accuracy[0]
    assert [r["metrics"]["val_accuracy"] for r in reports] == pytest.approx(curve[:4].tolist())
