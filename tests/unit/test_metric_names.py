"""What a job may write to its metrics and result files, so that the orchestrator can mirror it into
MLflow: metric names MLflow takes (the runtime's rule agrees with MLflow's own validation), steps that
fit MLflow's 64 bits; and where each report's line ends, from which a mirror carries on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import _validate_metric

from tunepod import runtime
from tunepod.runtime import ReportTail
from tunepod.runtime.metrics import MAX_STEP, METRIC_NAME_CHARACTERS, append_report, metric_name_problem

NAMES = [
    "val_accuracy",
    "val/acc",
    "train loss",
    "eval:top-1.5",
    "pr\u00e9cision",  # \w is Unicode, in MLflow as here
    "a" * 250,
    "a" * 251,
    "acc@1",
    "top(5)",
    "loss,train",
    "f1=0.5",
    "",
    ".",
    "..",
    "../loss",
    "..loss",
    "/loss",
    "loss/",
    "val//acc",
    "val/./acc",
    "val/../acc",
    "tab\there",
]


@pytest.mark.parametrize("name", NAMES)
def test_the_runtime_refuses_exactly_the_names_mlflow_refuses(name: str) -> None:
    try:
        _validate_metric(name, 1.0, 0, 0)
        mlflow_takes = True
    except MlflowException:
        mlflow_takes = False
    assert (metric_name_problem(name) is None) == mlflow_takes


def context(tmp_path: Path) -> runtime.TrainingContext:
    return runtime.init(
        environ={
            runtime.METRICS_FILE_ENV: str(tmp_path / "metrics.jsonl"),
            runtime.RESULT_FILE_ENV: str(tmp_path / "result.json"),
            runtime.CHECKPOINT_DIR_ENV: str(tmp_path / "checkpoints"),
        }
    )


def test_report_refuses_a_name_mlflow_refuses_naming_it_and_the_allowed_characters(tmp_path: Path) -> None:
    ctx = context(tmp_path)
    with pytest.raises(
        ValueError, match=re.escape("metric name 'acc@1' cannot be logged to MLflow")
    ) as error:
        ctx.report(0, **{"acc@1": 0.5, "loss": 1.0})
    assert METRIC_NAME_CHARACTERS in str(error.value)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_finish_refuses_a_name_mlflow_refuses(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("metric name 'val//acc' cannot be logged to MLflow")):
        context(tmp_path).finish(**{"val//acc": 0.5})
    assert not (tmp_path / "result.json").exists()


def test_a_step_beyond_64_bits_is_refused(tmp_path: Path) -> None:
    append_report(tmp_path / "metrics.jsonl", MAX_STEP, {"loss": 1.0})
    with pytest.raises(ValueError, match="at most"):
        append_report(tmp_path / "metrics.jsonl", MAX_STEP + 1, {"loss": 1.0})


def test_each_report_comes_with_the_end_of_its_line(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    append_report(metrics, 0, {"loss": 1.0})
    metrics.write_bytes(metrics.read_bytes() + b"not a report\n")
    append_report(metrics, 0, {"loss": 0.5})
    tail = ReportTail(metrics)
    ends = [end for _, end in tail.read_new_with_ends()]
    content = metrics.read_bytes()
    assert ends == [content.index(b"\n") + 1, len(content)]
    assert tail.offset == len(content)


@pytest.mark.parametrize("when", [float("nan"), float("inf"), -1.0])
def test_a_line_whose_time_is_no_time_is_not_a_report(tmp_path: Path, when: float) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 0, "metrics": {"loss": 1.0}, "time": when}) + "\n")
    assert runtime.read_reports(metrics) == []
