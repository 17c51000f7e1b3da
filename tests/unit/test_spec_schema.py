"""The spec's JSON Schema: what `tunepod schema` prints is the committed file the examples name, every
example passes it, and it catches what an editor should flag (an unknown key, a wrong type)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from tunepod.cli import app
from tunepod.spec.schema import SCHEMA_FILE, spec_json_schema_text

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").rglob("pipeline*.yaml"))


def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_tunepod_schema_prints_the_committed_file() -> None:
    """If this fails, the models changed: run `tunepod schema > tunepod/spec/pipeline.schema.json`."""
    printed = CliRunner().invoke(app, ["schema"])
    assert printed.exit_code == 0, printed.output
    assert printed.stdout == spec_json_schema_text() == SCHEMA_FILE.read_text()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.relative_to(REPO).as_posix())
def test_every_example_names_the_schema_and_passes_it(example: Path) -> None:
    first_line = example.read_text().splitlines()[0]
    assert first_line.startswith("# yaml-language-server: $schema=")
    named = (example.parent / first_line.partition("$schema=")[2]).resolve()
    assert named == SCHEMA_FILE
    errors = [
        f"{list(e.path)}: {e.message}" for e in validator().iter_errors(yaml.safe_load(example.read_text()))
    ]
    assert errors == []


def test_the_schema_flags_an_unknown_key_and_a_wrong_type() -> None:
    spec = yaml.safe_load((REPO / "examples/digits/pipeline.yaml").read_text())
    spec["steps"]["search"]["with"]["num_trial"] = 8
    spec["tracking"]["experiment"] = 3
    messages = {tuple(e.path): e.message for e in validator().iter_errors(spec)}
    assert messages.get(("tracking", "experiment")) == "3 is not of type 'string'"
    assert any("num_trial" in message for message in messages.values()), messages
