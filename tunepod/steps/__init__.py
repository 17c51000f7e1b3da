"""Step kinds: what each ``uses:`` does, and whether a retry of it is safe.

A kind is one function registered in ``STEP_KINDS``. Each kind says whether it is idempotent: a
Prefect retry (or a rerun of the pipeline) of an idempotent step re-attaches to, or finds, what its
first attempt made, instead of making it again. Only idempotent kinds are retried.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tunepod.outputs import StepOutput
from tunepod.steps import evaluate, export, register, stage, train, tune
from tunepod.steps.context import StepContext
from tunepod.steps.inputs import only_input, optional_input

if TYPE_CHECKING:
    from tunepod.hpo.tuner import TrialSubmitter

StepRunner = Callable[..., StepOutput]

__all__ = ["STEP_KINDS", "StepContext", "StepKind", "only_input", "optional_input", "run_step"]


@dataclass(frozen=True)
class StepKind:
    run: StepRunner
    idempotent: bool
    """How: stage copies what changed; tune, train and evaluate re-attach to their jobs through stable
    job dirs; register looks up the version of a logged model before creating one; export's tasks
    export what changed."""


STEP_KINDS: Mapping[str, StepKind] = {
    "stage": StepKind(stage.run, idempotent=True),
    "tune": StepKind(tune.run, idempotent=True),
    "train": StepKind(train.run, idempotent=True),
    "evaluate": StepKind(evaluate.run, idempotent=True),
    "register": StepKind(register.run, idempotent=True),
    "export": StepKind(export.run, idempotent=True),
}


def run_step(
    run: StepContext,
    name: str,
    inputs: Mapping[str, StepOutput],
    *,
    submit_trial: TrialSubmitter | None = None,
) -> StepOutput:
    step = run.spec.steps[name]
    kind = STEP_KINDS[step.uses]
    extra: dict[str, Any] = {"submit_trial": submit_trial} if step.uses == "tune" else {}
    return kind.run(run, name, step.with_, inputs, **extra)
