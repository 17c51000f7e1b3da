"""Dependencies run one way: spec <- launch <- tracking/hpo <- steps <- pipeline, and the library never
imports Prefect. Checked statically over every module's imports, TYPE_CHECKING ones included, so a
cycle cannot creep back in behind a lazy import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "tunepod"

# Package -> what it must never import.
FORBIDDEN = {
    "spec": ("tunepod.launch", "tunepod.hpo", "tunepod.steps", "tunepod.pipeline", "tunepod.tracking"),
    "launch": ("tunepod.hpo", "tunepod.steps", "tunepod.pipeline", "tunepod.tracking"),
    "runtime": ("tunepod.launch", "tunepod.hpo", "tunepod.steps", "tunepod.pipeline", "tunepod.tracking"),
    "tracking": ("tunepod.hpo", "tunepod.steps", "tunepod.pipeline"),
    "hpo": ("tunepod.steps", "tunepod.pipeline"),
    "steps": ("tunepod.pipeline",),
}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_above_it(package: str) -> None:
    offending = {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in (PACKAGE / package).rglob("*.py")
        for name in imported_modules(path)
        if name.startswith(FORBIDDEN[package])
    }
    assert not offending, sorted(offending)


def test_the_library_never_imports_prefect() -> None:
    offending = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in PACKAGE.rglob("*.py")
        for name in imported_modules(path)
        if name == "prefect" or name.startswith("prefect.")
    ]
    assert not offending, offending
