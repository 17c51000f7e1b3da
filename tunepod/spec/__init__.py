"""The pipeline spec: pydantic models, and loading a YAML file into them with readable errors."""

from tunepod.spec.models import PipelineSpec, StepSpec

__all__ = ["PipelineSpec", "StepSpec"]
