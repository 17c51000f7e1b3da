"""Job dirs are joined from the spec's names under ``<root>/jobs``; the join refuses a name that is not one
plain folder, whatever let it through (the spec refuses them first: tests/unit/test_spec_errors.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunepod.errors import TunepodError
from tunepod.launch.paths import SharedRoot


def test_job_dirs_nest_one_folder_per_name(tmp_path: Path) -> None:
    shared = SharedRoot(tmp_path)
    assert shared.jobs_dir("digits") == tmp_path / "jobs" / "digits"
    assert shared.jobs_dir("digits-hpo", "check", "trial-3-ab12") == (
        tmp_path / "jobs" / "digits-hpo" / "check" / "trial-3-ab12"
    )


@pytest.mark.parametrize("name", ["..", ".", "", "a/../..", "/etc", "a\\b"])
def test_a_name_that_is_not_one_folder_is_refused_where_the_path_is_joined(tmp_path: Path, name: str) -> None:
    shared = SharedRoot(tmp_path)
    with pytest.raises(TunepodError, match="cannot name a folder of job dirs") as study:
        shared.jobs_dir(name)
    assert repr(name) in str(study.value)
    with pytest.raises(TunepodError, match=r"fix: rename it: not '\.' or '\.\.', without '/' or"):
        shared.jobs_dir("digits-hpo", name, "key")


def test_a_shared_path_that_leaves_the_root_is_refused(tmp_path: Path) -> None:
    shared = SharedRoot(tmp_path / "shared")
    assert shared.resolve("fsx:///datasets/x") == (tmp_path / "shared" / "datasets" / "x").resolve()
    refusal = r"'fsx:///\.\./outside' leaves the launcher root .*; fix: remove its '\.\.'"
    with pytest.raises(TunepodError, match=refusal):
        shared.resolve("fsx:///../outside")
