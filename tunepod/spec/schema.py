"""The JSON Schema of a pipeline spec, for editors (completion, checks as you type) and other tools.

``tunepod schema`` prints it; ``tunepod/spec/pipeline.schema.json`` is the same text, committed, so an
example can name it in its first line (``# yaml-language-server: $schema=...``) and editors with the
YAML language server (VS Code's YAML extension, neovim, JetBrains) check the spec. A test keeps the
file equal to what the models say. The schema checks shapes (fields, types, ranges, unknown keys);
``tunepod validate`` checks the rest (the DAG, cross-field rules, files that must exist).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tunepod.spec.models import PipelineSpec

SCHEMA_FILE = Path(__file__).with_name("pipeline.schema.json")
SCHEMA_ID = "https://tunepod.dev/schemas/pipeline.schema.json"


def spec_json_schema() -> dict[str, Any]:
    """The schema of a spec file as written (``with:``, not the model's ``with_``)."""
    schema = PipelineSpec.model_json_schema(by_alias=True, mode="validation")
    header = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "tunepod pipeline spec",
    }
    return {**header, **{key: value for key, value in schema.items() if key != "title"}}


def spec_json_schema_text() -> str:
    return json.dumps(spec_json_schema(), indent=2, sort_keys=True) + "\n"
