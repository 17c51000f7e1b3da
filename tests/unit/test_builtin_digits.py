"""tunepod.staging.builtin: the digits splits, written reproducibly, and builtin:// URIs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from tunepod.errors import TunepodError
from tunepod.staging.builtin import BUILTIN_SOURCES, materialize_builtin, write_digits

DIGITS_TOTAL = 1797


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("digits")
    write_digits(dest)
    return dest


def sha256s(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_writes_three_splits_and_a_manifest_last(tmp_path: Path) -> None:
    written = write_digits(tmp_path / "out")
    assert [p.name for p in written] == ["train.npz", "val.npz", "test.npz", "dataset.json"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in written)  # no temp


def test_splits_are_70_15_15_and_stratified(digits: Path) -> None:
    labels = {name: np.load(digits / f"{name}.npz")["y"] for name in ("train", "val", "test")}
    assert sum(len(y) for y in labels.values()) == DIGITS_TOTAL
    assert [len(labels[name]) for name in ("train", "val", "test")] == [1257, 270, 270]
    per_class = np.bincount(np.concatenate(list(labels.values())))
    for y in (labels["val"], labels["test"]):
        # Stratified: each class keeps its share of the data, to within one image.
        assert np.all(np.abs(np.bincount(y, minlength=10) - per_class * 0.15) <= 1.5)


def test_arrays_are_float32_pixels_in_unit_range_and_int64_labels(digits: Path) -> None:
    with np.load(digits / "train.npz", allow_pickle=False) as arrays:
        assert sorted(arrays.files) == ["x", "y"]
        x, y = arrays["x"], arrays["y"]
    assert (x.dtype, x.shape[1], y.dtype) == (np.float32, 64, np.int64)
    assert x.min() == 0.0 and x.max() == 1.0
    assert set(np.unique(y)) == set(range(10))


def test_manifest_describes_the_files(digits: Path) -> None:
    manifest = json.loads((digits / "dataset.json").read_text())
    assert manifest["name"] == "digits" and manifest["seed"] == 0
    assert manifest["counts"] == {"train": 1257, "val": 270, "test": 270}
    assert manifest["source"] == "sklearn.datasets.load_digits"


def test_same_seed_gives_identical_bytes(digits: Path, tmp_path: Path) -> None:
    write_digits(tmp_path / "again", seed=0)
    assert sha256s(tmp_path / "again") == sha256s(digits)


def test_another_seed_gives_another_split(digits: Path, tmp_path: Path) -> None:
    write_digits(tmp_path / "other", seed=1)
    assert sha256s(tmp_path / "other")["train.npz"] != sha256s(digits)["train.npz"]


def test_materialize_writes_once_then_reuses_the_folder(tmp_path: Path) -> None:
    folder = materialize_builtin("builtin://digits", tmp_path / "cache")
    assert folder == tmp_path / "cache" / "digits"
    first = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert materialize_builtin("builtin://digits", tmp_path / "cache") == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == first
    assert set(first) == {"train.npz", "val.npz", "test.npz", "dataset.json"}


@pytest.mark.parametrize("uri", ["builtin://mnist", "s3://bucket/digits", "digits"])
def test_an_unknown_builtin_names_the_valid_ones(uri: str, tmp_path: Path) -> None:
    with pytest.raises(TunepodError, match="valid: builtin://digits"):
        materialize_builtin(uri, tmp_path)
    assert not list(tmp_path.iterdir())


def test_registry_lists_digits() -> None:
    assert BUILTIN_SOURCES["digits"] is write_digits
