"""The four tiny_llm specs (local, Slurm, HyperPod EKS, SageMaker) differ only where a backend must: the
launcher block and the stage step's source and target. (That every example validates is checked in
test_example_specs.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SPECS = {
    "local": "examples/tiny_llm/pipeline.yaml",
    "slurm": "examples/tiny_llm/pipeline-slurm.yaml",
    "hyperpod_eks": "examples/tiny_llm/pipeline-hyperpod-eks.yaml",
    "sagemaker": "examples/tiny_llm/pipeline-sagemaker.yaml",
}
STAGE_STEP = "corpus"


@pytest.mark.parametrize("kind", SPECS)
def test_the_launcher_block_names_its_backend(kind: str) -> None:
    assert _read(SPECS[kind])["launcher"]["kind"] == kind


@pytest.mark.parametrize("kind", [kind for kind in SPECS if kind != "local"])
def test_the_spec_differs_from_the_local_one_only_in_launcher_and_staging(kind: str) -> None:
    local, other = _without_backend(_read(SPECS["local"])), _without_backend(_read(SPECS[kind]))
    assert other == local


def _read(path: str) -> dict[str, Any]:
    loaded = yaml.safe_load((REPO / path).read_text())
    assert isinstance(loaded, dict)
    return loaded


def _without_backend(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` without its launcher and the stage step's settings (the parts allowed to differ)."""
    rest = {key: value for key, value in spec.items() if key != "launcher"}
    steps = dict(rest["steps"])
    stage = dict(steps[STAGE_STEP])
    assert stage["uses"] == "stage"
    stage.pop("with")
    steps[STAGE_STEP] = stage
    rest["steps"] = steps
    return rest
