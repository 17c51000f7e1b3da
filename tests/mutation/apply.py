"""Putting one mutant into a copy of ``tunepod/``, never into the repository's own files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from mutation.catalog import Mutant

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "tunepod"


class StaleCatalog(Exception):
    """A mutant's ``find`` is not in its file exactly once: the library changed under the catalog."""


def mutated_source(mutant: Mutant, root: Path = REPO_ROOT) -> str:
    """The text of ``mutant.path`` (read under ``root``) with the mutant's edit; ``StaleCatalog``
    naming the mutant and the file when ``find`` is not there exactly once."""
    text = (root / mutant.path).read_text(encoding="utf-8")
    count = text.count(mutant.find)
    if count != 1:
        where = "is not there" if count == 0 else f"occurs {count} times"
        raise StaleCatalog(
            f"mutant {mutant.name}: its `find` {where} in {mutant.path} (it must occur exactly once); "
            "the catalog went stale: update the mutant to the file as it is now (tests/mutation/catalog.py)"
        )
    return text.replace(mutant.find, mutant.replace)


def mutated_copy(mutant: Mutant, into: Path, root: Path = REPO_ROOT) -> Path:
    """A copy of ``root``'s ``tunepod/`` under ``into`` with ``mutant`` applied; returns ``into``,
    the folder to put first on ``PYTHONPATH``. The edit is made before anything is copied, so a stale
    mutant leaves nothing behind."""
    source = mutated_source(mutant, root)
    shutil.copytree(root / PACKAGE, into / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    (into / mutant.path).write_text(source, encoding="utf-8")
    return into


def simulation_env(copy: Path, root: Path = REPO_ROOT) -> dict[str, str]:
    """The environment of a simulation run on ``copy``: the copy before the repository's tests on the
    path (the package is also installed in editable mode, which a PYTHONPATH entry comes before)."""
    return {**os.environ, "PYTHONPATH": f"{copy}{os.pathsep}{root / 'tests'}", "PYTHONHASHSEED": "0"}


def package_origin(env: dict[str, str], python: str = sys.executable, cwd: Path = REPO_ROOT) -> Path:
    """Where ``import tunepod`` resolves under ``env``, as the simulation's interpreter sees it
    (``-P``: the working directory, the repository root, is not put on the path)."""
    probe = f"import importlib.util; print(importlib.util.find_spec({PACKAGE!r}).origin)"
    found = subprocess.run(
        [python, "-P", "-c", probe], env=env, cwd=cwd, capture_output=True, text=True, check=True
    )
    return Path(found.stdout.strip())
