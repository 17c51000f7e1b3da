"""Step kinds: what each ``uses:`` does. A kind is one function registered in ``STEP_KINDS``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from tunepod.outputs import StepOutput

if TYPE_CHECKING:
    from tunepod.hpo.tuner import TrialSubmitter
    from tunepod.pipeline import PipelineRun

StepRunner = Callable[..., StepOutput]
T = TypeVar("T")


def _registry() -> dict[str, StepRunner]:
    # Imported here: the step modules import this package's helpers.
    import tunepod.steps.evaluate
    import tunepod.steps.export
    import tunepod.steps.register
    import tunepod.steps.stage
    import tunepod.steps.train
    import tunepod.steps.tune

    return {
        "stage": tunepod.steps.stage.run,
        "tune": tunepod.steps.tune.run,
        "train": tunepod.steps.train.run,
        "evaluate": tunepod.steps.evaluate.run,
        "register": tunepod.steps.register.run,
        "export": tunepod.steps.export.run,
    }


def run_step(
    run: PipelineRun,
    name: str,
    inputs: Mapping[str, StepOutput],
    *,
    submit_trial: TrialSubmitter | None = None,
) -> StepOutput:
    step = run.spec.steps[name]
    runner = _registry()[step.uses]
    extra: dict[str, Any] = {"submit_trial": submit_trial} if step.uses == "tune" else {}
    return runner(run, name, step.with_, inputs, **extra)


def only_input(inputs: Mapping[str, StepOutput], kind: type[T], step: str) -> T:
    """The single input of type ``kind``; the DAG check guarantees there is exactly one."""
    found = [value for value in inputs.values() if isinstance(value, kind)]
    if len(found) != 1:
        raise TypeError(f"step {step} expected one {kind.__name__} input, got {len(found)}")
    return found[0]


def optional_input(inputs: Mapping[str, StepOutput], kind: type[T]) -> T | None:
    found = [value for value in inputs.values() if isinstance(value, kind)]
    return found[0] if found else None
