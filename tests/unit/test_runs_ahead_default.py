"""Whether a tune step makes MLflow runs ahead of its trials (``tracking.runs_ahead``): by default on
a store that takes concurrent writes, not on SQLite (one writer at a time; see
``tunepod.steps.tune.run_reserve_opener``); a number set in the spec wins either way."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from tunepod.steps.context import StepContext
from tunepod.steps.tune import run_reserve_opener


def step_context(uri: str, runs_ahead: int | None) -> StepContext:
    spec = SimpleNamespace(tracking=SimpleNamespace(uri=uri, runs_ahead=runs_ahead))
    return cast(StepContext, SimpleNamespace(spec=spec, tracker=None, run_id="p"))


@pytest.mark.parametrize(
    ("uri", "runs_ahead", "opens"),
    [
        ("sqlite:///mlflow.db", None, False),
        ("sqlite:///mlflow.db", 3, True),
        ("http://127.0.0.1:5000", None, True),
        ("postgresql://u:p@db/mlflow", None, True),
        ("http://127.0.0.1:5000", 0, False),
    ],
)
def test_runs_are_made_ahead_by_default_except_on_sqlite(
    tmp_path: Path, uri: str, runs_ahead: int | None, opens: bool
) -> None:
    opener = run_reserve_opener(step_context(uri, runs_ahead), tmp_path)
    assert (opener is not None) == opens
