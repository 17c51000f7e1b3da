"""Picking a step's inputs from the outputs of the steps it needs (the DAG checked their kinds)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from tunepod.outputs import StepOutput

T = TypeVar("T")


def only_input(inputs: Mapping[str, StepOutput], kind: type[T], step: str) -> T:
    """The single input of type ``kind``; the DAG check guarantees there is exactly one."""
    found = [value for value in inputs.values() if isinstance(value, kind)]
    if len(found) != 1:
        raise TypeError(f"step {step} expected one {kind.__name__} input, got {len(found)}")
    return found[0]


def optional_input(inputs: Mapping[str, StepOutput], kind: type[T]) -> T | None:
    found = [value for value in inputs.values() if isinstance(value, kind)]
    return found[0] if found else None
