"""A new SQLite tracking store is a copy of a cached empty store that MLflow built (real MLflow)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tunepod.tracking import MlflowTracker
from tunepod.tracking.sqlite_store import CACHE_ENV, empty_store, seed_new_store


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    monkeypatch.chdir(tmp_path)  # MLflow puts a store's Default experiment under the working folder
    return folder


def test_a_new_store_is_the_cached_copy_and_opens_as_a_fresh_one_would(
    cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    built_by_mlflow = MlflowClient(f"sqlite:///{tmp_path / 'plain.db'}").get_experiment("0")

    first = MlflowTracker(f"sqlite:///{tmp_path / 'first.db'}", "digits")
    cached = empty_store()
    assert cached.parent == cache and cached.is_file()
    built_at = cached.stat().st_mtime_ns
    caplog.set_level(logging.INFO, logger="mlflow.store.db.utils")
    caplog.clear()
    second = MlflowTracker(f"sqlite:///{tmp_path / 'second.db'}", "digits")

    assert cached.stat().st_mtime_ns == built_at, "the cache was built again"
    assert "Creating initial MLflow database tables" not in caplog.text, "MLflow migrated the copy"
    for tracker in (first, second):
        default = tracker.client.get_experiment("0")
        assert (default.name, default.artifact_location) == (
            built_by_mlflow.name,
            built_by_mlflow.artifact_location,
        )
        [experiment] = [e for e in tracker.client.search_experiments() if e.name == "digits"]
        run = tracker.client.create_run(experiment.experiment_id)
        tracker.client.log_metric(run.info.run_id, "acc", 0.5)
        assert tracker.client.get_run(run.info.run_id).data.metrics == {"acc": 0.5}
    assert first.experiment_id == second.experiment_id == "1"


def test_an_existing_store_and_other_uris_are_left_alone(cache: Path, tmp_path: Path) -> None:
    existing = tmp_path / "existing.db"
    MlflowClient(f"sqlite:///{existing}").create_experiment("kept")
    before = existing.read_bytes()
    assert seed_new_store(f"sqlite:///{existing}") is False
    assert existing.read_bytes() == before
    assert seed_new_store("http://127.0.0.1:5000") is False
    assert seed_new_store(f"sqlite:///{tmp_path / 'no-such-folder' / 'x.db'}") is False
    assert not list(tmp_path.glob(".*.seeding"))
    assert not cache.exists(), "nothing needed the cache"


def test_without_a_usable_cache_mlflow_builds_the_store_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    assert seed_new_store(f"sqlite:///{tmp_path / 'x.db'}") is False
    assert not (tmp_path / "x.db").exists() and not list(tmp_path.glob(".x.db.*"))
    tracker = MlflowTracker(f"sqlite:///{tmp_path / 'x.db'}", "digits")
    assert tracker.client.get_experiment_by_name("digits") is not None


def test_a_store_another_tool_made_meanwhile_is_never_replaced(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A race stood in for in-process (another process creating the store between tunepod's look and
    its copy cannot be timed from here): the store appears while the copy is made."""
    database = tmp_path / "raced.db"
    copy = shutil.copyfile

    def copy_while_another_tool_creates_the_store(source: Path, target: Path) -> object:
        MlflowClient(f"sqlite:///{database}").create_experiment("theirs")
        return copy(source, target)

    monkeypatch.setattr(
        "tunepod.tracking.sqlite_store.shutil.copyfile", copy_while_another_tool_creates_the_store
    )
    assert seed_new_store(f"sqlite:///{database}") is False
    assert MlflowClient(f"sqlite:///{database}").get_experiment_by_name("theirs") is not None
    assert not list(tmp_path.glob(".*.seeding"))
