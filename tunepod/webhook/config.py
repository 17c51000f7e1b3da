"""The receiver's configuration: which hooks exist, their secrets, their spec and payload mapping.

    # deployments/webhooks.yaml
    hooks:
      s3-upload:                          # POST /hooks/s3-upload
        spec: examples/digits/pipeline.yaml
        scheme: standard                  # standard (webhook-*) | github (X-Hub-Signature-256) |
                                          # eventbridge (an API destination's X-Tunepod-Key)
        secrets:                          # several = rotation: any one of them verifies
          - env: TUNEPOD_HOOK_S3_SECRET
          - file: /run/secrets/s3-hook-previous
        rate_limit_per_min: 30
        overrides:
          - "steps.data.with.source=s3://{payload.Records[0].s3.bucket.name}/{payload.Records[0].s3.object.key|urldecode|dirname}"
        allow:                            # the S3 objects a delivery may name (``allowlist``)
          - {bucket: my-data, prefix: digits/}

The spec of a hook is fixed here; a payload only fills the values of ``--set`` overrides, through
``{payload.<path>}`` placeholders. A path is dotted keys with ``[n]`` list indexes; keys containing
``.``, ``[``, ``]``, ``{`` or ``}`` cannot be addressed. A placeholder may only stand after the ``=``
(a payload never chooses what is set, only the value) and only reaches a string, number, boolean or
null. A value that is exactly one placeholder keeps the payload's type (``num_trials={payload.n}``
with ``n: 20`` sets 20); a value that mixes text and placeholders is always a string. ``{{`` and
``}}`` write literal braces. Spec paths are relative to the directory the receiver runs in, like
the paths inside a spec.

Filters after ``|`` turn a text value into another text, left to right:

- ``urldecode``: undo URL form encoding (``%2F``, ``+`` for a space). S3 event notifications send
  object keys encoded this way.
- ``dirname``: everything up to and including the last ``/`` (empty when there is none): the folder
  an object was put in, e.g. the dataset prefix an uploaded file belongs to. A filter makes the
  value text, also in a lone placeholder.

``allow`` lists the buckets, and the folders of their keys, that a delivery may name: a body naming
any other S3 object, or an override filled from it with any other ``s3://`` URL, is refused (403) and
starts nothing (``allowlist`` says how keys are matched). A hook must have one when its scheme is
``eventbridge`` (an API key is a bearer credential: whoever holds it can post any body, so the key
cannot be what bounds the data a run reads) or when an override builds an ``s3://`` URL from the
payload; the configuration does not load otherwise.

Secrets are read once, when the configuration loads (to rotate: add the new secret, restart, remove the
old one later). A secret file holds one secret per non-empty line. Secrets are held as
``pydantic.SecretStr``: they never show in a repr, a log line or an error message.

``load_webhook_config`` reports every problem at once, each naming the hook and the field.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from tunepod.errors import TunepodError
from tunepod.webhook.allowlist import S3_SCHEME, AllowedPrefix, Allowlist, has_dot_segment
from tunepod.webhook.signatures import MIN_API_KEY_CHARS, SecretFormatError, standard_key

HOOK_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
# What the stage step takes (tunepod.staging.s3), legacy names with capitals and '_' included.
_BUCKET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]$")
ALLOW_EXAMPLE = "allow: [{bucket: my-data, prefix: digits/}]"
_PLACEHOLDER_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_PATH_SEGMENT = re.compile(r"\.([^.\[\]{}]+)|\[(\d+)\]")

Scalar = str | int | float | bool | None


class WebhookConfigError(TunepodError):
    """A configuration the receiver must not start with; the message lists every problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
        body = "\n".join(f"  {problem}" for problem in problems)
        super().__init__(f"invalid webhook config {source} ({count}):\n{body}")


class PayloadError(TunepodError):
    """A payload that lacks a field an override needs, or holds a list or mapping there."""


# ---------------------------------------------------------------------------------------------- file models


class SecretSource(BaseModel):
    """Where one or more secrets of a hook come from: an environment variable or a file."""

    model_config = ConfigDict(extra="forbid")

    env: str | None = Field(None, description="Name of an environment variable holding one secret.")
    file: Path | None = Field(None, description="A file holding one secret per non-empty line.")

    @model_validator(mode="after")
    def _exactly_one(self) -> SecretSource:
        if (self.env is None) == (self.file is None):
            raise ValueError("give exactly one of env: or file:")
        return self


class AllowEntry(BaseModel):
    """One place in S3 that a hook's deliveries may name: a bucket, and a folder of its keys."""

    model_config = ConfigDict(extra="forbid")

    bucket: str = Field(description="An S3 bucket's name, matched exactly (my-data, not s3://my-data/).")
    prefix: str = Field(
        "",
        description=(
            "A folder of the bucket's keys, ending in '/' (raw/ matches raw/x, never raw-evil/x); "
            "'' for the whole bucket. Compared with the object key as S3 stores it (URL-decoded)."
        ),
    )

    @field_validator("bucket")
    @classmethod
    def _bucket_name(cls, bucket: str) -> str:
        if not _BUCKET_NAME.match(bucket):
            raise ValueError(
                f"{bucket[:80]!r} is not an S3 bucket name; write the bare name (letters, digits, '.', "
                "'-', '_'), like my-data, with the folder in prefix:"
            )
        return bucket

    @field_validator("prefix")
    @classmethod
    def _folder(cls, prefix: str) -> str:
        if prefix.startswith("/") or "//" in prefix:
            raise ValueError(
                f"{prefix[:80]!r} has an empty segment; S3 keys start without '/': write it like digits/v2/"
            )
        if prefix and not prefix.endswith("/"):
            raise ValueError(
                f"{prefix[:80]!r} does not end with '/', so it would also match {prefix[:80] + '-other/'!r}; "
                f"write {prefix[:80] + '/'!r} (a folder)"
            )
        if has_dot_segment(prefix):
            raise ValueError(
                f"{prefix[:80]!r} has a '.' or '..' segment, which no allowed key may have; write the "
                "folder plainly"
            )
        return prefix


class HookFile(BaseModel):
    """One hook as written in the configuration file."""

    model_config = ConfigDict(extra="forbid")

    spec: str = Field(description="The pipeline spec this hook runs; fixed, never taken from a payload.")
    scheme: Literal["standard", "github", "eventbridge"] = Field(
        "standard",
        description=(
            "How deliveries prove their sender: Standard Webhooks signatures (webhook-*), GitHub's "
            "(X-Hub-Signature-256), or an EventBridge API destination's API key (X-Tunepod-Key)."
        ),
    )
    secrets: list[SecretSource] = Field(min_length=1, description="Active secrets; any one verifies.")
    rate_limit_per_min: int = Field(60, ge=1, description="Accepted deliveries per minute (token bucket).")
    overrides: list[str] = Field(
        default_factory=list, description="--set overrides, with {payload.<path>} placeholders in values."
    )
    allow: list[AllowEntry] | None = Field(
        None,
        min_length=1,
        description=(
            "The S3 buckets and key prefixes a delivery may name; any other is refused (403). Required "
            "for scheme eventbridge, and for a hook whose overrides build an s3:// URL from the payload."
        ),
    )


class ConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hooks: dict[str, HookFile] = Field(min_length=1)


# ---------------------------------------------------------------------------------------------- resolved


@dataclass(frozen=True)
class Placeholder:
    """``{payload.<path>|filter|...}``: a path of keys (str) and indexes (int), then text filters."""

    path: tuple[str | int, ...]
    filters: tuple[str, ...] = ()

    def value(self, payload: Any) -> Scalar:
        """The payload's value at the path, through the filters; raises ``PayloadError``."""
        value = _scalar_at(payload, self.path)
        for name in self.filters:
            if not isinstance(value, str):
                where = format_payload_path(self.path)
                raise PayloadError(f"{where} is {json.dumps(value)}, not text: filter {name!r} takes text")
            value = FILTERS[name](value)
        return value


#: Text filters a placeholder may name after ``|`` (see the module docstring).
FILTERS: dict[str, Callable[[str], str]] = {
    "urldecode": urllib.parse.unquote_plus,
    "dirname": lambda text: text[: text.rfind("/") + 1],
}


@dataclass(frozen=True)
class OverrideTemplate:
    """One ``dotted.path=value`` override whose value may hold ``{payload.<path>}`` placeholders."""

    key: str
    # Literal text and placeholders, in order.
    parts: tuple[str | Placeholder, ...]

    @classmethod
    def parse(cls, text: str) -> OverrideTemplate:
        """Parse ``text``; raises ``ValueError`` saying what is wrong with it."""
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise ValueError("expected dotted.path=value")
        if "{" in key or "}" in key:
            raise ValueError("placeholders may only stand in the value, after '='")
        return cls(key.strip(), tuple(_template_parts(value)))

    @property
    def fills_from_payload(self) -> bool:
        return any(isinstance(part, Placeholder) for part in self.parts)

    @property
    def builds_s3_url(self) -> bool:
        """Whether the value writes ``s3://`` before a placeholder: the payload picks an S3 location."""
        text = ""
        for part in self.parts:
            if isinstance(part, Placeholder) and S3_SCHEME in text:
                return True
            text += part if isinstance(part, str) else ""
        return False

    def render(self, payload: Any) -> str:
        """The override with the payload's values filled in; raises ``PayloadError``."""
        if len(self.parts) == 1 and isinstance(self.parts[0], Placeholder):
            # A lone placeholder keeps the payload's type; JSON is YAML, and the loader reads YAML.
            return f"{self.key}={json.dumps(self.parts[0].value(payload))}"
        if all(isinstance(part, str) for part in self.parts):
            return f"{self.key}={''.join(str(part) for part in self.parts)}"
        text = "".join(
            part if isinstance(part, str) else _as_text(part.value(payload)) for part in self.parts
        )
        # Quoted, so that a payload cannot turn the value into a list or mapping by writing YAML.
        return f"{self.key}={json.dumps(text)}"


@dataclass(frozen=True)
class Hook:
    """A hook ready to serve: secrets read, templates parsed. Immutable, safe to share across threads."""

    name: str
    spec: str
    scheme: Literal["standard", "github", "eventbridge"]
    secrets: tuple[SecretStr, ...]
    rate_limit_per_min: int
    overrides: tuple[OverrideTemplate, ...]
    allow: Allowlist | None = None

    def secret_values(self) -> list[str]:
        return [secret.get_secret_value() for secret in self.secrets]

    def render_overrides(self, payload: Any) -> list[str]:
        return [template.render(payload) for template in self.overrides]

    def forbidden_body(self, payload: Any) -> str | None:
        """Why ``payload`` names an S3 object outside the allow list, or None (always, without one)."""
        return None if self.allow is None else self.allow.body_problem(payload)

    def forbidden_overrides(self, overrides: list[str]) -> str | None:
        """Why an override filled from the payload names an ``s3://`` URL outside the allow list."""
        if self.allow is None:
            return None
        filled = [
            (index, override)
            for index, (template, override) in enumerate(zip(self.overrides, overrides, strict=True))
            if template.fills_from_payload
        ]
        return self.allow.overrides_problem(filled)


@dataclass(frozen=True)
class WebhookConfig:
    hooks: Mapping[str, Hook]


def load_webhook_config(path: Path | str, environ: Mapping[str, str] | None = None) -> WebhookConfig:
    """Read and check the configuration file; raises ``WebhookConfigError`` listing every problem."""
    source = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise WebhookConfigError(source, [f"file not found (looked for {Path(path).absolute()})"]) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise WebhookConfigError(source, [f"cannot read the file: {exc}"]) from None
    return parse_webhook_config(data, source, os.environ if environ is None else environ)


def parse_webhook_config(data: Any, source: str, environ: Mapping[str, str]) -> WebhookConfig:
    """Check the parsed YAML ``data`` (``source`` names it in messages); see ``load_webhook_config``."""
    try:
        parsed = ConfigFile.model_validate(data)
    except ValidationError as exc:
        raise WebhookConfigError(source, [_pydantic_problem(error) for error in exc.errors()]) from None
    problems: list[str] = []
    hooks = {name: _resolve_hook(name, hook, environ, problems) for name, hook in parsed.hooks.items()}
    if problems:
        raise WebhookConfigError(source, problems)
    return WebhookConfig(hooks)


def _resolve_hook(name: str, hook: HookFile, environ: Mapping[str, str], problems: list[str]) -> Hook:
    where = f"hooks.{name}"
    if not HOOK_NAME.match(name):
        problems.append(f"{where}: the hook name must be lowercase letters, digits, '-' or '_' (64 at most)")
    if not Path(hook.spec).is_file():
        problems.append(
            f"{where}.spec: spec file {hook.spec!r} does not exist (looked for "
            f"{Path(hook.spec).absolute()}); spec paths are relative to the directory the receiver runs in"
        )
    secrets = [
        secret
        for index, source in enumerate(hook.secrets)
        for secret in _read_secrets(f"{where}.secrets[{index}]", source, environ, problems)
    ]
    if hook.scheme == "eventbridge":
        for index, secret in enumerate(secrets):
            if len(secret.get_secret_value()) < MIN_API_KEY_CHARS:
                problems.append(
                    f"{where}.secrets: key #{index + 1} has fewer than {MIN_API_KEY_CHARS} characters; an "
                    "API key travels whole in a header, so make it long and random (openssl rand -hex 24)"
                )
    if hook.scheme == "standard":
        for index, secret in enumerate(secrets):
            try:
                standard_key(secret.get_secret_value())
            except SecretFormatError as exc:
                problems.append(f"{where}.secrets: secret #{index + 1}: {exc}")
    templates = []
    for index, text in enumerate(hook.overrides):
        try:
            templates.append(OverrideTemplate.parse(text))
        except ValueError as exc:
            problems.append(f"{where}.overrides[{index}]: {exc} (in {text!r})")
    missing = _missing_allow(where, hook, templates)
    if missing is not None:
        problems.append(missing)
    return Hook(
        name,
        hook.spec,
        hook.scheme,
        tuple(secrets),
        hook.rate_limit_per_min,
        tuple(templates),
        _allowlist(name, hook.allow),
    )


def _missing_allow(where: str, hook: HookFile, templates: list[OverrideTemplate]) -> str | None:
    """Why the hook needs an allow list it lacks: refused at load rather than found out by a forged
    delivery, since without one whoever can post picks the data a run stages."""
    if hook.allow is not None:
        return None
    if hook.scheme == "eventbridge":
        why = (
            "an eventbridge hook's API key is a bearer credential (whoever holds it can post any event, "
            "naming any bucket)"
        )
    else:
        builders = [index for index, template in enumerate(templates) if template.builds_s3_url]
        if not builders:
            return None
        why = f"overrides[{builders[0]}] builds an s3:// URL from the payload: a delivery picks the data"
    return (
        f"{where}.allow: missing; {why}. List the S3 buckets and key prefixes its deliveries may name, "
        f"e.g. {ALLOW_EXAMPLE}"
    )


def _allowlist(name: str, entries: list[AllowEntry] | None) -> Allowlist | None:
    if entries is None:
        return None
    return Allowlist(name, tuple(AllowedPrefix(entry.bucket, entry.prefix) for entry in entries))


def _read_secrets(
    where: str, source: SecretSource, environ: Mapping[str, str], problems: list[str]
) -> list[SecretStr]:
    if source.env is not None:
        value = environ.get(source.env, "").strip()
        if not value:
            problems.append(f"{where}.env: environment variable {source.env} is not set or empty; export it")
            return []
        return [SecretStr(value)]
    assert source.file is not None  # the model checks that exactly one of env and file is given
    try:
        lines = source.file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        problems.append(f"{where}.file: cannot read secret file {source.file}: {exc.strerror}")
        return []
    secrets = [SecretStr(line.strip()) for line in lines if line.strip()]
    if not secrets:
        problems.append(f"{where}.file: secret file {source.file} is empty")
    return secrets


def _pydantic_problem(error: Any) -> str:
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
    if error["type"] == "extra_forbidden":
        return f"{path}: unknown key; valid keys: {_valid_keys(error['loc'])}"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{path or '<root>'}: {message}"


def _valid_keys(loc: tuple[Any, ...]) -> str:
    # loc is ("hooks", name, "secrets" or "allow", i, key), ("hooks", name, key) or (key,)
    models: dict[int, type[BaseModel]] = {1: ConfigFile, 3: HookFile, 5: SecretSource}
    model = AllowEntry if len(loc) == 5 and loc[2] == "allow" else models.get(len(loc), ConfigFile)
    return ", ".join(model.model_fields)


# ---------------------------------------------------------------------------------------------- templates


def _template_parts(value: str) -> list[str | Placeholder]:
    parts: list[str | Placeholder] = []
    position = 0
    for match in _PLACEHOLDER_TOKEN.finditer(value):
        parts.append(value[position : match.start()])
        token = match.group(0)
        if token in ("{{", "}}"):
            parts.append(token[0])
        elif match.group(1) is None:
            raise ValueError(f"unmatched {token!r}; write {token * 2} for a literal brace")
        else:
            parts.append(_placeholder(match.group(1)))
        position = match.end()
    parts.append(value[position:])
    return _join_text([part for part in parts if part != ""])


def _join_text(parts: list[str | Placeholder]) -> list[str | Placeholder]:
    joined: list[str | Placeholder] = []
    for part in parts:
        if joined and isinstance(part, str) and isinstance(joined[-1], str):
            joined[-1] += part
        else:
            joined.append(part)
    return joined


def _placeholder(text: str) -> Placeholder:
    path, *filters = text.split("|")
    for name in filters:
        if name.strip() not in FILTERS:
            raise ValueError(
                f"placeholder {{{text}}}: unknown filter {name.strip()!r}; known: {', '.join(FILTERS)}"
            )
    return Placeholder(_payload_path(path.strip()), tuple(name.strip() for name in filters))


def _payload_path(text: str) -> tuple[str | int, ...]:
    if not text.startswith("payload"):
        raise ValueError(f"placeholder {{{text}}} must start with 'payload', like {{payload.repo.name}}")
    rest = text.removeprefix("payload")
    segments: list[str | int] = []
    position = 0
    while position < len(rest):
        match = _PATH_SEGMENT.match(rest, position)
        if match is None:
            raise ValueError(f"placeholder {{{text}}}: expected .key or [index] at {rest[position:]!r}")
        segments.append(match.group(1) if match.group(1) is not None else int(match.group(2)))
        position = match.end()
    if not segments:
        raise ValueError("placeholder {payload} needs a path to one value, like {payload.ref}")
    return tuple(segments)


def format_payload_path(path: tuple[str | int, ...]) -> str:
    return "payload" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path)


def _scalar_at(payload: Any, path: tuple[str | int, ...]) -> Scalar:
    value = payload
    for depth, segment in enumerate(path, start=1):
        in_list = isinstance(segment, int) and isinstance(value, list) and segment < len(value)
        in_mapping = isinstance(segment, str) and isinstance(value, dict) and segment in value
        if not (in_list or in_mapping):
            raise PayloadError(f"the payload has no {format_payload_path(path[:depth])}")
        value = value[segment]
    if isinstance(value, dict | list):
        kind = "list" if isinstance(value, list) else "mapping"
        raise PayloadError(f"{format_payload_path(path)} is a {kind}; an override takes a single value")
    return value  # type: ignore[no-any-return]


def _as_text(value: Scalar) -> str:
    return value if isinstance(value, str) else json.dumps(value)
