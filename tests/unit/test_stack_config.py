from pathlib import Path

import pytest

from tunepod.stack.config import StackConfig, default_mlflow_workers


@pytest.mark.parametrize(("cores", "workers"), [(None, 1), (1, 1), (2, 2), (4, 4), (64, 4)])
def test_the_mlflow_server_gets_no_more_workers_than_cores_and_at_most_mlflows_four(
    monkeypatch: pytest.MonkeyPatch, cores: int | None, workers: int
) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert default_mlflow_workers() == workers
    assert StackConfig(home=Path("h"), repo=Path("r")).mlflow_workers == workers
