"""The common settings of a run as typed values (the Prefect deployment's run form, and any caller
that prefers them to ``dotted.path=value`` strings), turned into the overrides they stand for.

Typed values come first and free ``overrides`` after them, so an explicit override still wins.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field

from tunepod.errors import SpecError, SpecIssue
from tunepod.spec.models import (
    HyperPodEksLauncherSpec,
    LocalLauncherSpec,
    NumParallel,
    SageMakerLauncherSpec,
    SlurmLauncherSpec,
    Strict,
)

LauncherKind = Literal["local", "slurm", "hyperpod_eks", "sagemaker"]
LAUNCHER_MODELS: dict[str, type[Strict]] = {
    "local": LocalLauncherSpec,
    "slurm": SlurmLauncherSpec,
    "hyperpod_eks": HyperPodEksLauncherSpec,
    "sagemaker": SageMakerLauncherSpec,
}


class RunForm(BaseModel):
    """What the run form offers besides the spec path and the free overrides."""

    num_trials: int | None = Field(
        None, ge=1, description="Finished trials each tune step's study should hold."
    )
    num_parallel: NumParallel | None = Field(
        None,
        description="Trials in flight at once in each tune step's study, or auto: as many as the "
        "cluster runs at once (local and slurm launchers).",
    )
    experiment: str | None = Field(None, min_length=1, description="MLflow experiment of the pipeline run.")
    launcher: LauncherKind | None = Field(
        None, description="Run the jobs on this launcher, keeping the spec's launcher settings it also has."
    )

    def overrides(self, spec_path: str | Path) -> list[str]:
        """The ``dotted.path=value`` overrides these values stand for in the spec at ``spec_path``."""
        written = _as_written(spec_path)
        set_: list[str] = []
        if self.num_trials is not None or self.num_parallel is not None:
            for step in tune_steps(written, spec_path):
                if self.num_trials is not None:
                    set_.append(f"steps.{step}.with.num_trials={self.num_trials}")
                if self.num_parallel is not None:
                    set_.append(f"steps.{step}.with.num_parallel={self.num_parallel}")
        if self.experiment is not None:
            set_.append(f"tracking.experiment={json.dumps(self.experiment)}")
        if self.launcher is not None:
            set_.append(f"launcher={json.dumps(switched_launcher(written, self.launcher))}")
        return set_


def _as_written(spec_path: str | Path) -> dict[str, Any]:
    """The spec file as written; empty when it cannot be read (validation, which comes after with the
    overrides, reports that with its reason, and every other problem with its line)."""
    try:
        data = yaml.safe_load(Path(spec_path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def tune_steps(written: dict[str, Any], spec_path: str | Path) -> list[str]:
    """The names of the spec's tune steps."""
    steps = written.get("steps")
    if not isinstance(steps, dict):
        return []
    names = [n for n, step in steps.items() if isinstance(step, dict) and step.get("uses") == "tune"]
    if not names:
        issue = SpecIssue("steps", "num_trials and num_parallel set a tune step's, and the spec has none")
        raise SpecError(str(spec_path), [SpecIssue(issue.path, issue.message, "leave them empty")])
    return names


def switched_launcher(written: dict[str, Any], kind: str) -> dict[str, Any]:
    """A launcher block of ``kind`` that keeps the settings of the spec's block that ``kind`` also
    has (``root``, ``env``...); what ``kind`` needs besides is reported by validation, by name."""
    block = written.get("launcher")
    fields = LAUNCHER_MODELS[kind].model_fields
    kept = {k: v for k, v in block.items() if k in fields and k != "kind"} if isinstance(block, dict) else {}
    return {"kind": kind, **kept}
