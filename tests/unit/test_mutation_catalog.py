"""The mutation catalog (tests/mutation) cannot rot silently, and its runner mutates copies only."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from mutation.apply import (
    REPO_ROOT,
    StaleCatalog,
    mutated_copy,
    mutated_source,
    package_origin,
    simulation_env,
)
from mutation.catalog import MUTANTS, Mutant
from mutation.hunt import judge


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda mutant: mutant.name)
def test_each_mutant_applies_once_and_compiles(mutant: Mutant) -> None:
    path = REPO_ROOT / mutant.path
    assert mutant.path.startswith("tunepod/"), "a mutant changes library code"
    assert path.read_text(encoding="utf-8").count(mutant.find) == 1, "the catalog went stale"
    assert mutant.replace != mutant.find
    compile(mutated_source(mutant), str(path), "exec")
    assert mutant.why.strip()


def test_mutant_names_are_unique() -> None:
    names = [mutant.name for mutant in MUTANTS]
    assert len(names) == len(set(names))


def test_a_stale_mutant_is_refused_naming_it_and_its_file() -> None:
    stale = Mutant("gone", "tunepod/launch/drive.py", find="no such code", replace="x", why="-")
    with pytest.raises(StaleCatalog, match=r"mutant gone: .* tunepod/launch/drive\.py"):
        mutated_source(stale)


def test_the_runner_mutates_a_copy_and_leaves_the_repository_untouched(tmp_path: Path) -> None:
    mutant = MUTANTS[0]
    original = REPO_ROOT / mutant.path
    before = _digests(REPO_ROOT / "tunepod")

    copy = mutated_copy(mutant, tmp_path)

    mutated = (copy / mutant.path).read_text(encoding="utf-8")
    assert mutant.replace in mutated and mutant.find not in mutated
    assert original.read_text(encoding="utf-8").count(mutant.find) == 1
    assert _digests(REPO_ROOT / "tunepod") == before
    # The simulation's interpreter imports the copy, not the repository's (nor the editable install's).
    assert package_origin(simulation_env(copy)).is_relative_to(copy)


def test_verdicts_read_from_the_simulations_output() -> None:
    mutant = MUTANTS[0]
    found = judge(mutant, "seed 17: exactly once: trial 3 ran twice\nseeds: 5, violations: 1 (...)", 1, 2.0)
    assert (found.status, found.seed, found.violation) == ("found", 17, "exactly once: trial 3 ran twice")
    assert judge(mutant, "seeds: 300, violations: 0 (30 s)", 0, 30.0).status == "survived"
    assert judge(mutant, "... 250 seeds, 0 violating, 9 s\n", None, 9.0).seeds_run == 250
    assert judge(mutant, "Traceback ...\nImportError: x", 1, 1.0).status == "error"


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*.py"))
    }
