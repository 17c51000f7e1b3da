"""The run form's typed fields become the overrides they stand for (the flow's parameters and their
schema are tested against a real Prefect server in tests/integration/test_prefect_tasks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunepod.errors import SpecError
from tunepod.run_form import RunForm
from tunepod.spec.loader import load_spec

SPEC = "examples/digits/pipeline.yaml"


def test_typed_fields_become_overrides_that_the_spec_accepts(in_repo: Path) -> None:
    form = RunForm(num_trials=5, num_parallel=3, experiment="nightly runs", launcher="slurm")
    overrides = form.overrides(SPEC)
    assert overrides == [
        "steps.search.with.num_trials=5",
        "steps.search.with.num_parallel=3",
        'tracking.experiment="nightly runs"',
        'launcher={"kind": "slurm", "root": ".tunepod/shared"}',  # root kept: slurm has one too
    ]
    spec = load_spec(SPEC, [*overrides, "steps.search.with.num_trials=7"])  # a free override wins
    search = spec.steps["search"].with_
    assert (search.num_trials, search.num_parallel) == (7, 3)  # type: ignore[union-attr]
    assert spec.tracking.experiment == "nightly runs" and spec.launcher.kind == "slurm"
    assert RunForm().overrides(SPEC) == []


def test_num_trials_on_a_spec_without_a_tune_step_says_so(tmp_path: Path) -> None:
    spec = tmp_path / "stage-only.yaml"
    spec.write_text("name: s\ntracking: {experiment: e}\nsteps:\n  data: {uses: stage, with: {source: x}}\n")
    with pytest.raises(SpecError, match="set a tune step's, and the spec has none"):
        RunForm(num_trials=3).overrides(spec)
