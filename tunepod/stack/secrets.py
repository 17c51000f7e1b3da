"""Hook secrets for the stack's webhook receiver when the user exported none.

A hook whose secret comes from an environment variable that is not set gets a secret generated once
into ``<home>/secrets/<VARIABLE>`` (mode 0600, in a 0700 folder) and handed to the receiver in that
variable, so ``tunepod up`` starts on a fresh machine; the user reads the file to sign deliveries. An
exported variable always wins over the file. Secrets read from files (``file:``) are left to the
receiver, which refuses to start without them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from tunepod.webhook.config import ConfigFile
from tunepod.webhook.signatures import new_standard_secret


@dataclass(frozen=True)
class GeneratedSecrets:
    env: dict[str, str]
    """Variable -> secret, for the receiver's environment."""
    files: dict[str, Path]
    """Variable -> the file its secret is kept in."""

    def note(self) -> str:
        """What the user needs to know to sign a delivery (empty when nothing was generated)."""
        if not self.files:
            return ""
        names = ", ".join(self.files)
        folder = next(iter(self.files.values())).parent
        return f"generated secrets for {names} in {folder}/ (export NAME=$(cat {folder}/NAME) to sign)"


def unset_secret_variables(webhook_config: Path, environ: Mapping[str, str]) -> list[str]:
    """The ``env:`` secret variables of the receiver's hooks that ``environ`` lacks. An unreadable or
    invalid config yields none: the receiver itself reports what is wrong with it."""
    try:
        parsed = ConfigFile.model_validate(yaml.safe_load(webhook_config.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValidationError):
        return []
    names = [source.env for hook in parsed.hooks.values() for source in hook.secrets if source.env]
    return sorted({name for name in names if not environ.get(name, "").strip()})


def generate_missing(webhook_config: Path, secrets_dir: Path) -> GeneratedSecrets:
    """A secret for each unset variable: the one kept in ``secrets_dir`` from an earlier ``up``, or a
    new one written there first (so that a restarted receiver keeps the same secret)."""
    env: dict[str, str] = {}
    files: dict[str, Path] = {}
    for name in unset_secret_variables(webhook_config, os.environ):
        path = secrets_dir / name
        if not path.is_file():
            write_private(path, new_standard_secret())
        env[name], files[name] = path.read_text(encoding="utf-8").strip(), path
    return GeneratedSecrets(env, files)


def write_private(path: Path, text: str) -> None:
    """Write ``text`` readable by its owner only, whole or not at all."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text + "\n")
        out.flush()
        os.fsync(out.fileno())
    partial.replace(path)
