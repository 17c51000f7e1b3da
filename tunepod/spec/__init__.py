"""The pipeline spec: pydantic models, and loading a YAML file into them with readable errors."""

from tunepod.spec.loader import OverrideIssue, dump_spec, load_spec, parse_spec, spec_hash
from tunepod.spec.models import PipelineSpec, StepSpec

__all__ = ["OverrideIssue", "PipelineSpec", "StepSpec", "dump_spec", "load_spec", "parse_spec", "spec_hash"]
