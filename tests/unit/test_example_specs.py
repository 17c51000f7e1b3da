"""Every pipeline spec under ``examples/`` is valid as shipped: ``tunepod validate`` accepts it from the
repository root (placeholders such as account ids and file system ids are well-formed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tunepod.cli import app

REPO = Path(__file__).resolve().parents[2]
SPECS = sorted(path.relative_to(REPO).as_posix() for path in (REPO / "examples").rglob("pipeline*.yaml"))

runner = CliRunner()


def test_the_examples_cover_every_launcher() -> None:
    kinds = {kind for kind in ("slurm", "hyperpod-eks", "sagemaker", "fsx") if any(kind in s for s in SPECS)}
    assert kinds == {"slurm", "hyperpod-eks", "sagemaker", "fsx"}, SPECS


@pytest.mark.parametrize("spec", SPECS)
def test_tunepod_validate_accepts_the_example(spec: str, in_repo: Path) -> None:
    result = runner.invoke(app, ["validate", spec])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"OK {spec}: pipeline "), result.stdout
