"""Which command lines the ``tunepod`` entry point hands to the stack's runner before importing the
command line (tunepod/entry.py): a plain `tunepod run`, and nothing it could misread."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunepod.entry import plain_run_home


@pytest.mark.parametrize(
    ("args", "home"),
    [
        (["run", "spec.yaml"], ".tunepod"),
        (["run", "spec.yaml", "--set", "a.b=1", "--set=c=-2"], ".tunepod"),
        (["run", "--home", "/srv/stack", "spec.yaml"], "/srv/stack"),
        (["run", "spec.yaml", "--home=/srv/stack", "--set", "--home=not-this"], "/srv/stack"),
    ],
)
def test_a_plain_run_goes_to_the_runner_of_its_home(args: list[str], home: str) -> None:
    assert plain_run_home(args, {}) == Path(home)


def test_the_home_comes_from_tunepod_home_unless_given() -> None:
    assert plain_run_home(["run", "s.yaml"], {"TUNEPOD_HOME": "/env/home"}) == Path("/env/home")
    assert plain_run_home(["run", "s.yaml", "--home", "/arg"], {"TUNEPOD_HOME": "/env"}) == Path("/arg")


@pytest.mark.parametrize(
    "args",
    [
        ["validate", "spec.yaml"],
        ["run"],
        ["run", "a.yaml", "b.yaml"],
        ["run", "spec.yaml", "--help"],
        ["run", "spec.yaml", "--hme", "x"],
        ["run", "spec.yaml", "--set"],
        ["run", "spec.yaml", "--", "x"],
    ],
)
def test_anything_else_goes_to_the_full_command_line(args: list[str]) -> None:
    assert plain_run_home(args, {}) is None


def test_a_chosen_prefect_server_keeps_the_run_in_its_own_process() -> None:
    assert plain_run_home(["run", "spec.yaml"], {"PREFECT_API_URL": "http://elsewhere/api"}) is None
