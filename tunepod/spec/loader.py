"""Load a pipeline spec from YAML and report every problem at its file line, YAML path and fix.

One pass collects all the problems of a spec before anything runs: YAML syntax, duplicate keys, what
the pydantic models reject (unknown keys, missing fields, wrong types, unknown step kinds, failed
cross-field checks), then, once the models accept it, how the steps connect (``tunepod.dag``) and
whether the entrypoint scripts exist. They are raised together as one ``SpecError``:

    examples/digits/pipeline.yaml:14: steps.search.with.num_trials: expected an integer, got 'ten'
        fix: set num_trials to an integer (Finished trials the study should hold, counting earlier runs.)

``--set dotted.path=value`` overrides are applied to the parsed document before validation, so the same
models check them; a problem they cause is reported against the override instead of a file line.

Paths inside a spec (entrypoints, ``sqlite:///`` files) are relative to the directory tunepod runs in,
not to the spec file: ``entrypoint: examples/digits/train.py`` works from the repository root.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Self, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

# ``tunepod.dag`` imports the spec models, so it is imported as a module (not ``from ... import name``)
# to keep ``import tunepod.dag`` working when it comes before ``import tunepod.spec``.
from tunepod import dag
from tunepod.errors import SpecError, SpecIssue
from tunepod.spec.models import EvaluateStep, PipelineSpec, StepSpec, TrainStep, TuneStep
from tunepod.stores import redacted, secret_values

YamlPath = tuple[str | int, ...]
_MERGE_TAG = "tag:yaml.org,2002:merge"
# libyaml's parser where PyYAML was built with it: the same documents, nodes and marks, ~15x faster than
# the pure-Python one (the webhook receiver checks a spec per delivery).
_SAFE_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class OverrideIssue(SpecIssue):
    """An issue caused by a ``--set`` override: it is located by the override, not by a file line."""

    override: str = ""

    def render(self, source: str) -> str:
        # The override may set a store URI or a job's credentials: shown as tunepod shows any.
        return super().render(f"--set {shown_override(self.override)}")


# ---------------------------------------------------------------------------------------------- public API


def shown_override(override: str) -> str:
    """A ``--set dotted.path=value`` override as tunepod shows it (messages, logs, MLflow tags): a URL's
    password hidden, and so is every value it gives a secret name of an ``env`` mapping
    (``--set launcher.env.HF_TOKEN=...`` or ``--set 'launcher.env={HF_TOKEN: ...}'``)."""
    key, sep, value_text = override.partition("=")
    if not sep:
        return redacted(override)
    try:
        value = yaml.load(value_text, Loader=_SAFE_LOADER)
    except yaml.YAMLError:  # no structure to read: every "NAME: value" pair of a secret name is hidden
        value = {name: found for name, found in _NAMED_VALUE.findall(value_text)}
    for part in reversed(key.strip().split(".")):
        value = {part: value}
    return redacted(override, values=secret_values(value))


# A ``NAME: value`` or ``NAME=value`` pair in text that is not valid YAML, quoted or not.
_NAMED_VALUE = re.compile(r"""([A-Za-z_][\w.-]*)["']?\s*[:=]\s*["']?([^"',}\]\s]+)""")


def load_spec(
    path: Path | str,
    overrides: Sequence[str] = (),
    *,
    check_files: bool = True,
    base_dir: Path | None = None,
) -> PipelineSpec:
    """Read, override and validate the spec file at ``path``; raises ``SpecError`` listing every problem.

    ``overrides`` are ``dotted.path=value`` strings (the CLI's ``--set``); each value is read as YAML.
    With ``check_files`` the entrypoint scripts must exist; relative ones resolve against ``base_dir``,
    by default the current working directory (paths in a spec are relative to where tunepod runs).
    A missing or unreadable file is a ``SpecError`` too.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(source, [_file_issue("file not found", path)]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(source, [_file_issue(f"cannot read the file: {exc}", path)]) from None
    return parse_spec(text, source, overrides, check_files, base_dir)


def parse_spec(
    text: str,
    source: str,
    overrides: Sequence[str] = (),
    check_files: bool = True,
    base_dir: Path | None = None,
) -> PipelineSpec:
    """Validate the spec ``text`` (``source`` names it in messages); see ``load_spec`` for the rest."""
    parsed = _read_yaml(text, source)
    # Copies: the overrides below write into the document and drop the lines they replace, and the
    # models keep references into it.
    raw = pickle.loads(parsed.pickled)
    lines, problems = dict(parsed.lines), list(parsed.duplicates)
    issues: list[SpecIssue] = []
    origins = _apply_overrides(raw, overrides, lines, parsed.below, issues)
    spec = None
    try:
        spec = PipelineSpec.model_validate(raw)
    except ValidationError as exc:
        problems += _validation_problems(exc, raw)
    if spec is not None:
        problems += dag.find_problems(spec)
        if check_files:
            problems += _entrypoint_problems(spec, base_dir or os.getcwd())
    issues += [_locate(problem, lines, origins) for problem in problems]
    if issues:
        raise SpecError(source, sorted(issues, key=_reading_order))
    assert spec is not None  # no issues means the models accepted the document
    return spec


def spec_hash(spec: PipelineSpec) -> str:
    """sha256 of the spec's canonical JSON: equal for specs that mean the same, whatever their layout.

    Taken with the store passwords hidden (as ``dump_spec`` shows them): the hash is an MLflow tag,
    beside the dumped spec, and must not let anyone test guesses of a password; a new password is not
    a new meaning either."""
    document = _shown(spec.model_dump(mode="json", by_alias=True))
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def dump_spec(spec: PipelineSpec) -> str:
    """The resolved spec as YAML (defaults filled in, ``with`` spelled as in files), for logging: every
    string as tunepod shows it (``redacted``), so a spec with a store password reads back with ``***``."""
    return yaml.safe_dump(_shown(spec.model_dump(mode="json", by_alias=True)), sort_keys=False)


def _shown(document: Any, values: Sequence[str] | None = None) -> Any:
    """``document`` (a dumped spec) with each string ``redacted``, the values of its ``env`` mappings'
    secret names (``secret_values``) hidden wherever they occur."""
    if values is None:
        values = secret_values(document)
    if isinstance(document, str):
        return redacted(document, values=values)
    if isinstance(document, dict):
        return {key: _shown(value, values) for key, value in document.items()}
    if isinstance(document, list):
        return [_shown(item, values) for item in document]
    return document


# ---------------------------------------------------------------------------------------------- YAML


@dataclass(frozen=True)
class _ParsedText:
    """What a spec's text says before any override: never modified (``parse_spec`` copies it)."""

    pickled: bytes
    """The document (a dict) pickled: unpickling is a deep copy in C (3.5x copy.deepcopy's speed here,
    once the largest share of a spec check's CPU) that keeps shared and recursive YAML aliases."""
    lines: dict[YamlPath, int]
    duplicates: list[dag.Problem]
    below: dict[YamlPath, tuple[YamlPath, ...]]
    """Each located path's located paths at or below it: what an override there replaces. Kept with
    the text, so an override costs the size of what it replaces, not a scan of every line."""


@functools.lru_cache(maxsize=16)
def _read_yaml(text: str, source: str) -> _ParsedText:
    """The document as a dict, its lines and its duplicated keys; ``SpecError`` if unusable.

    Once per text: a webhook receiver checks the same spec file with other overrides for every
    delivery, and YAML was most of that check's time (PyYAML constructs the objects in Python even
    with libyaml's parser). A ``SpecError`` is raised each time, never cached."""
    loader = _SAFE_LOADER(text)
    try:
        root = loader.get_single_node()  # parsed once; the dict is constructed from these nodes
        # Read before constructing: construction expands merge keys (<<: *base) in the nodes themselves.
        lines, duplicates = (_line_map(root), _duplicate_keys(root)) if root is not None else ({}, [])
        raw = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as exc:
        raise SpecError(source, [_yaml_syntax_issue(exc)]) from None
    except yaml.YAMLError as exc:
        raise SpecError(source, [SpecIssue("", f"not valid YAML: {exc}", "fix the YAML syntax")]) from None
    finally:
        loader.dispose()
    if root is None or raw is None:
        fix = "declare name, tracking, launcher and steps; examples/digits/pipeline.yaml is a starting point"
        raise SpecError(source, [SpecIssue("", "the spec is empty", fix, line=1)])
    if not isinstance(raw, dict):
        message = f"expected a mapping at the top (name:, tracking:, steps:), got {_describe(raw)}"
        fix = "write the spec as keys at the top level: name, tracking, launcher, steps"
        raise SpecError(source, [SpecIssue("", message, fix, line=root.start_mark.line + 1)])
    return _ParsedText(pickle.dumps(raw, pickle.HIGHEST_PROTOCOL), lines, duplicates, _subtrees(lines))


def _subtrees(lines: dict[YamlPath, int]) -> dict[YamlPath, tuple[YamlPath, ...]]:
    found: dict[YamlPath, list[YamlPath]] = {}
    for path in lines:
        for depth in range(len(path) + 1):
            found.setdefault(path[:depth], []).append(path)
    return {path: tuple(paths) for path, paths in found.items()}


def _yaml_syntax_issue(exc: yaml.MarkedYAMLError) -> SpecIssue:
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark is not None else None
    context = f" ({exc.context})" if exc.context else ""
    fix = "check the indentation, the colons and the quoting"
    fix += f" on line {line} and the lines just before it" if line else ""
    return SpecIssue("", f"YAML syntax error: {exc.problem}{context}", fix, line)


def _line_map(root: yaml.Node) -> dict[YamlPath, int]:
    """Map every key and list item of the composed document to its 1-based line."""
    lines: dict[YamlPath, int] = {(): root.start_mark.line + 1}
    # A key written twice keeps the line of its last occurrence: that is the value YAML keeps.
    lines.update((path, key_node.start_mark.line + 1) for path, key_node, _ in _entries(root))
    return lines


def _entries(root: yaml.Node) -> list[tuple[YamlPath, yaml.Node, yaml.Node]]:
    """(path, node that starts the entry, value node) for each mapping entry and list item, depth first.

    Merge keys (``<<: *base``) are skipped: the keys they bring in are located at their parent. A
    recursive alias is visited once.
    """
    keys = yaml.constructor.SafeConstructor()
    found: list[tuple[YamlPath, yaml.Node, yaml.Node]] = []
    active: set[int] = set()

    def visit(node: yaml.Node, path: YamlPath) -> None:
        if id(node) in active:
            return
        active.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                    child = (*path, keys.construct_object(key_node))
                    found.append((child, key_node, value_node))
                    visit(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                found.append(((*path, index), item, item))
                visit(item, (*path, index))
        active.discard(id(node))

    visit(root, ())
    return found


def _duplicate_keys(root: yaml.Node) -> list[dag.Problem]:
    """YAML keeps only the last of two equal keys; a spec that says something twice is an error."""
    first_line: dict[YamlPath, int] = {}
    duplicated: set[YamlPath] = set()
    problems = []
    for path, key_node, _ in _entries(root):
        line = key_node.start_mark.line + 1
        # Keys inside a duplicated mapping repeat too; the duplicate above them is the one to report.
        if any(path[:depth] in duplicated for depth in range(len(path))):
            continue
        if path in first_line and isinstance(path[-1], str):
            duplicated.add(path)
            problems.append(
                dag.Problem(
                    path,
                    f"key {path[-1]!r} appears twice (lines {first_line[path]} and {line}); "
                    "YAML keeps only the last",
                    "remove or rename one of them",
                )
            )
        first_line.setdefault(path, line)
    return problems


# ---------------------------------------------------------------------------------------------- overrides


def _apply_overrides(
    raw: dict[Any, Any],
    overrides: Sequence[str],
    lines: dict[YamlPath, int],
    below: dict[YamlPath, tuple[YamlPath, ...]],
    issues: list[SpecIssue],
) -> dict[YamlPath, str]:
    """Set each ``dotted.path=value`` into ``raw``; returns the override that set or created each path.

    File lines at and under an overridden path (``below``) are dropped from ``lines``, so a problem
    there is reported against the override. Malformed overrides are appended to ``issues`` and not applied.
    """
    origins: dict[YamlPath, str] = {}
    for override in overrides:
        try:
            path, value = _parse_override(override)
            created = _set_path(raw, path, value)
        except _BadOverride as bad:
            issues.append(OverrideIssue(bad.path, bad.message, bad.fix, override=override))
            continue
        for stale in below.get(path, ()):
            lines.pop(stale, None)  # an earlier override may have replaced it already
        origins.update(dict.fromkeys([*created, path], override))
    return origins


@dataclass
class _BadOverride(Exception):
    path: str
    message: str
    fix: str


_DECIMAL_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")


def _parse_override(override: str) -> tuple[tuple[str, ...], Any]:
    key, sep, value_text = override.partition("=")
    path = tuple(key.strip().split("."))
    if not sep or not all(path):
        raise _BadOverride(
            key.strip(),
            "malformed override: expected dotted.path=value",
            "write it like --set steps.search.with.num_trials=20",
        )
    if _DECIMAL_INT.fullmatch(value_text):  # the usual value, read as YAML reads it, 30x faster
        return path, int(value_text)
    try:
        return path, yaml.safe_load(value_text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        shown_key, _, shown_value = shown_override(override).partition("=")
        fix = f"quote the value: --set {shown_key}='{shown_value}'"
        raise _BadOverride(key, f"the value is not valid YAML: {redacted(problem)}", fix) from None


def _set_path(raw: dict[Any, Any], path: tuple[str, ...], value: Any) -> list[YamlPath]:
    """Set ``raw[path] = value``, creating missing mappings; returns the paths of the mappings created."""
    created: list[YamlPath] = []
    target = raw
    for depth, key in enumerate(path[:-1], start=1):
        if target.get(key) is None:
            target[key] = {}
            created.append(path[:depth])
        elif not isinstance(target[key], dict):
            where = ".".join(path[:depth])
            raise _BadOverride(
                ".".join(path),
                f"the path goes through {where}, which is {_describe(target[key])}, not a mapping",
                f"set {where} itself (--set {where}=...) or correct the path",
            )
        target = target[key]
    target[path[-1]] = value
    return created


# ---------------------------------------------------------------------------------------------- locating


def _locate(problem: dag.Problem, lines: dict[YamlPath, int], origins: dict[YamlPath, str]) -> SpecIssue:
    """Attach the override or file line of the nearest located ancestor (a missing key has no line)."""
    text = dag.format_path(problem.path)
    for depth in range(len(problem.path), -1, -1):
        prefix = problem.path[:depth]
        if prefix in origins:
            return OverrideIssue(text, problem.message, problem.fix, override=origins[prefix])
        if prefix in lines:
            return SpecIssue(text, problem.message, problem.fix, lines[prefix])
    return SpecIssue(text, problem.message, problem.fix)


def _reading_order(issue: SpecIssue) -> tuple[bool, int]:
    return (issue.line is None, issue.line or 0)


def _file_issue(message: str, path: Path | str) -> SpecIssue:
    where = Path(path).absolute()
    fix = "check the path; it is relative to the current directory"
    return SpecIssue("", f"{message} (looked for {where})", fix)


# ---------------------------------------------------------------------------------------------- files


def _entrypoint_problems(spec: PipelineSpec, base_dir: Path | str) -> list[dag.Problem]:
    problems = []
    for name, step in spec.steps.items():
        for tail, entrypoint in _entrypoints(step):
            # os.path, not pathlib: this runs for every webhook delivery with new overrides, and
            # building Path objects was a fifth of that check's CPU.
            resolved = os.path.join(base_dir, entrypoint)  # an absolute entrypoint stays as it is
            if not os.path.isfile(resolved):
                problems.append(
                    dag.Problem(
                        ("steps", name, "with", *tail),
                        f"entrypoint {entrypoint!r} does not exist (looked for {resolved})",
                        f"correct the path; a relative path resolves against {base_dir}, where tunepod runs",
                    )
                )
    return problems


def _entrypoints(step: StepSpec) -> list[tuple[tuple[str, ...], str]]:
    """(path under ``with``, script) of each script ``step`` runs."""
    if isinstance(step, TuneStep | TrainStep):
        return [(("train", "entrypoint"), step.with_.train.entrypoint)]
    if isinstance(step, EvaluateStep):
        return [(("entrypoint",), step.with_.entrypoint)]
    return []


# ---------------------------------------------------------------------------------------------- pydantic


@dataclass(frozen=True)
class _Declared:
    """What the models declare at one place in the document: a type, its union tag field, its doc."""

    annotation: Any
    discriminator: str | None = None
    description: str | None = None

    @classmethod
    def of(cls, annotation: Any, discriminator: str | None = None, description: str | None = None) -> Self:
        while get_origin(annotation) is Annotated:
            annotation, *metadata = get_args(annotation)
            for item in metadata:
                if isinstance(item, FieldInfo) and isinstance(item.discriminator, str):
                    discriminator = item.discriminator
        # pydantic reports inside an optional model (``X | None``) with no union member in ``loc``, so
        # it is walked as the model (else its unknown keys read as "expected a mapping or null").
        members = get_args(annotation) if _is_union(annotation) else ()
        if len(members) == 2 and NoneType in members:
            inner = next(member for member in members if member is not NoneType)
            annotation = inner if _is_model(inner) else annotation
        return cls(annotation, discriminator, description)

    @property
    def model(self) -> type[BaseModel] | None:
        return self.annotation if _is_model(self.annotation) else None

    @property
    def members(self) -> tuple[Any, ...]:
        return get_args(self.annotation) if _is_union(self.annotation) else (self.annotation,)

    def child(self, segment: str | int) -> _Declared:
        if self.model is not None:
            for name, info in self.model.model_fields.items():
                if segment in (name, info.alias):
                    discriminator = info.discriminator if isinstance(info.discriminator, str) else None
                    return _Declared.of(info.annotation, discriminator, info.description)
        origin, args = get_origin(self.annotation), get_args(self.annotation)
        if origin is dict and len(args) == 2:
            return _Declared.of(args[1])
        if origin is list and args:
            return _Declared.of(args[0])
        return _Declared(Any)

    def tags(self) -> list[str]:
        """The values the discriminator may take, one per union member."""
        return [str(tag) for member in self.members for tag in self._member_tags(member)]

    def member_for(self, tag: str) -> _Declared:
        member = next((m for m in self.members if tag in self._member_tags(m)), Any)
        return _Declared(member)

    def _member_tags(self, member: Any) -> tuple[Any, ...]:
        info = member.model_fields.get(self.discriminator) if _is_model(member) else None
        return get_args(info.annotation) if info is not None else ()


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _is_union(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, UnionType)


@dataclass
class _Walk:
    """A pydantic ``loc`` turned into the YAML path a user wrote, with what is declared along it.

    Pydantic inserts segments that are not in the document: the tag of a discriminated union
    (``steps.search.tune.with``), the member it tried of a plain union (``choices.0.str``) and
    ``[key]`` for a bad dict key. They are dropped; ``declared[i]`` describes ``path[:i]``.
    """

    path: list[str | int] = field(default_factory=list)
    declared: list[_Declared] = field(default_factory=lambda: [_Declared(PipelineSpec)])
    union_at: YamlPath | None = None
    union: _Declared = field(default_factory=lambda: _Declared(Any))
    bad_key: bool = False

    @classmethod
    def along(cls, loc: tuple[str | int, ...]) -> _Walk:
        walk = cls()
        for segment in loc:
            walk._step(segment)
        return walk

    def _step(self, segment: str | int) -> None:
        here = self.declared[-1]
        if segment == "[key]":
            self.bad_key = True
        elif here.discriminator and isinstance(segment, str) and _is_union_or_model(here.annotation):
            self.declared[-1] = here.member_for(segment)
        elif _is_union(here.annotation) and isinstance(segment, str) and self.union_at is None:
            self.union_at = tuple(self.path)
            self.union = here
            self.declared[-1] = _Declared(Any, description=here.description)
        else:
            self.path.append(segment)
            self.declared.append(here.child(segment))

    @property
    def here(self) -> _Declared:
        return self.declared[-1]

    @property
    def parent(self) -> _Declared:
        return self.declared[-2] if len(self.declared) > 1 else _Declared(Any)

    @property
    def name(self) -> str:
        """How a fix names the spot: its key, or ``needs[0]`` for a list item."""
        if not self.path:
            return "the spec"
        if isinstance(self.path[-1], int):
            return dag.format_path(tuple(self.path[-2:]))
        return str(self.path[-1])


def _is_union_or_model(annotation: Any) -> bool:
    return _is_union(annotation) or _is_model(annotation)


def _validation_problems(exc: ValidationError, raw: dict[Any, Any]) -> list[dag.Problem]:
    """One problem per pydantic error; the errors of one plain union (one per member tried) become one."""
    problems: list[dag.Problem] = []
    unions_seen: set[YamlPath] = set()
    for error in exc.errors(include_url=False):
        walk = _Walk.along(error["loc"])
        if walk.union_at is not None:
            if walk.union_at not in unions_seen:
                unions_seen.add(walk.union_at)
                problems.append(_union_mismatch(error, walk, raw))
            continue
        problems.append(_problem(error, walk))
    return problems


def _problem(error: ErrorDetails, walk: _Walk) -> dag.Problem:
    kind = error["type"]
    path = tuple(walk.path)
    if walk.bad_key or kind == "invalid_key":
        # pydantic writes a key True as 1 in ``loc``; put the key itself back so the path reads right.
        return dag.Problem(
            (*path[:-1], error["input"]),
            f"the key {_describe(error['input'])} is not a string",
            "quote the key (YAML reads yes/no/on/off as booleans and digits as numbers)",
        )
    if kind == "extra_forbidden":
        return _unknown_key(walk)
    if kind == "missing":
        return _missing(walk)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return _bad_tag(error, walk)
    if kind == "literal_error":
        return _bad_literal(error, walk)
    if kind in ("value_error", "assertion_error"):
        return _failed_check(error, walk)
    if kind in _EXPECTED:
        expected = _EXPECTED[kind]
        message = f"expected {expected}, got {_describe(error['input'])}"
        return dag.Problem(path, message, _with_doc(f"set {walk.name} to {expected}", walk))
    return _constraint(error, walk)


def _unknown_key(walk: _Walk) -> dag.Problem:
    key = str(walk.path[-1])
    model = walk.parent.model
    if model is None:
        return dag.Problem(tuple(walk.path), f"unknown key {key!r}", "remove it")
    valid = [info.alias or name for name, info in model.model_fields.items()]
    match = dag.closest(key, valid)
    fix = f"did you mean {match!r}? rename the key" if match else "remove it"
    return dag.Problem(tuple(walk.path), f"unknown key {key!r}; valid keys here: {', '.join(valid)}", fix)


def _missing(walk: _Walk) -> dag.Problem:
    key = str(walk.path[-1])
    doc = walk.here.description or _first_doc_line(walk.here.annotation)
    where = f"under {dag.format_path(tuple(walk.path[:-1]))}" if len(walk.path) > 1 else "at the top level"
    message = f"missing required key {key!r}" + (f" ({doc})" if doc else "")
    return dag.Problem(tuple(walk.path), message, f"add {key}: {where}")


# How users name the discriminator of each union (the key that says which kind of thing a mapping is).
_TAG_NOUNS = {"uses": "step kind", "kind": "launcher kind", "type": "search parameter type"}


def _bad_tag(error: ErrorDetails, walk: _Walk) -> dag.Problem:
    discriminator = walk.here.discriminator or "kind"
    noun = _TAG_NOUNS.get(discriminator, f"{discriminator!r} value")
    tags = walk.here.tags()
    path = (*walk.path, discriminator)
    choices = ", ".join(tags)
    if error["type"] == "union_tag_not_found":
        fix = f"add {discriminator}: one of {choices}"
        return dag.Problem(path, f"missing {discriminator!r}, the {noun}", fix)
    tag = str(error.get("ctx", {}).get("tag", ""))
    return dag.Problem(path, f"unknown {noun} {tag!r}", f"use one of: {choices}{dag.did_you_mean(tag, tags)}")


def _bad_literal(error: ErrorDetails, walk: _Walk) -> dag.Problem:
    annotation = walk.here.annotation
    choices = [str(c) for c in get_args(annotation)] if get_origin(annotation) is Literal else []
    given = _describe(error["input"])
    if not choices:
        expected = str(error.get("ctx", {}).get("expected", ""))
        return dag.Problem(tuple(walk.path), f"{given} is not allowed", f"use {expected}")
    hint = dag.did_you_mean(str(error["input"]), choices)
    listed = ", ".join(choices)
    return dag.Problem(tuple(walk.path), f"{given} is not one of: {listed}", f"use one of: {listed}{hint}")


def _failed_check(error: ErrorDetails, walk: _Walk) -> dag.Problem:
    # The models word their checks as "<what is wrong>; fix: <what to do>".
    cause = error.get("ctx", {}).get("error")
    text = str(cause) if cause is not None else error["msg"].removeprefix("Value error, ")
    message, _, fix = text.partition("; fix: ")
    return dag.Problem(tuple(walk.path), message, fix or f"correct {walk.name}")


def _union_mismatch(error: ErrorDetails, walk: _Walk, raw: Any) -> dag.Problem:
    at = walk.union_at or ()
    forms = [_TYPE_NOUNS.get(member, "a mapping") for member in walk.union.members]
    given = _describe(_value_at(raw, at))
    expected = ", ".join(forms[:-1]) + f" or {forms[-1]}" if len(forms) > 1 else forms[0]
    return dag.Problem(at, f"expected {expected}, got {given}", f"change it to {expected}")


def _value_at(raw: Any, path: YamlPath) -> Any:
    """The raw value at ``path``, or None where the document has no such place."""
    for segment in path:
        try:
            raw = raw[segment]
        except (KeyError, IndexError, TypeError):
            return None
    return raw


def _constraint(error: ErrorDetails, walk: _Walk) -> dag.Problem:
    """Bounds, lengths and patterns: pydantic's own wording, made to read as a rule about the key."""
    ctx = error.get("ctx", {})
    if error["type"] == "too_short":
        entries = "1 entry" if ctx.get("min_length") == 1 else f"{ctx.get('min_length')} entries"
        message = f"needs at least {entries}, has {ctx.get('actual_length')}"
    else:
        # "Input should be greater than ..." -> "must be greater than ..., got 0"
        message = re.sub(r"^\w+ should", "must", error["msg"]) + f", got {_describe(error['input'])}"
    fixes = {
        "greater_than_equal": f"set {walk.name} to {ctx.get('ge')} or more",
        "greater_than": f"set {walk.name} above {ctx.get('gt')}",
        "less_than_equal": f"set {walk.name} to {ctx.get('le')} or less",
        "less_than": f"set {walk.name} below {ctx.get('lt')}",
        "too_short": f"add entries to {walk.name}",
        "string_too_short": f"give {walk.name} a non-empty value",
        "string_pattern_mismatch": f"change {walk.name} to match {ctx.get('pattern')}",
    }
    fix = fixes.get(error["type"], f"correct {walk.name}")
    return dag.Problem(tuple(walk.path), message, _with_doc(fix, walk))


def _with_doc(fix: str, walk: _Walk) -> str:
    return f"{fix} ({walk.here.description})" if walk.here.description else fix


def _first_doc_line(annotation: Any) -> str | None:
    doc = annotation.__doc__ if _is_model(annotation) else None
    return doc.strip().splitlines()[0] if doc else None


# What pydantic's type errors expected, in the words of a YAML file.
_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "a whole number",
    "float_parsing": "a number",
    "float_type": "a number",
    "finite_number": "a finite number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}
_TYPE_NOUNS: dict[Any, str] = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true/false",
    NoneType: "null",
}


def _describe(value: Any) -> str:
    """A value as the YAML reader wrote it: ``'ten'``, ``3``, ``true``, ``null``, ``a mapping``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(redacted(value)) if isinstance(value, str) else str(value)
