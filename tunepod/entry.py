"""The ``tunepod`` command's entry point: hand a plain ``tunepod run`` straight to the local stack's
runner, before importing anything else.

Importing the command line itself (typer, rich, pydantic and the spec models) takes about a second;
the runner (``tunepod.stack.runner``) has it imported already, checks the spec in its child and reports
any error there, on this command's stderr, with the same exit status. Only a command line made of
``run``, one spec and ``--set``/``--home`` options goes this way, and only when no ``PREFECT_API_URL``
is set; anything else, or a runner that is absent or refuses, goes to the full command line
(``tunepod.cli``), which may still hand the run over once it has checked the spec.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tunepod.stack.config import DEFAULT_HOME
from tunepod.stack.runner import exit_like, forward_run, say_on_stderr

_VALUED_OPTIONS = ("--set", "--home")


def main() -> None:
    args = sys.argv[1:]
    home = plain_run_home(args, os.environ)
    if home is not None:
        status = forward_run(home, args, say_on_stderr)
        if status is not None:
            sys.exit(exit_like(status))
    from tunepod.cli import app

    app()


def plain_run_home(args: Sequence[str], environ: Mapping[str, str]) -> Path | None:
    """The stack home of ``tunepod run SPEC [--set X]... [--home H]`` (``--opt=value`` forms too), when
    that is all the command line holds and no Prefect server is chosen; None for anything else."""
    if list(args[:1]) != ["run"] or environ.get("PREFECT_API_URL"):
        return None
    home, positional, rest = environ.get("TUNEPOD_HOME") or DEFAULT_HOME, 0, list(args[1:])
    while rest:
        token = rest.pop(0)
        name, equals, value = token.partition("=")
        if name in _VALUED_OPTIONS and not equals:
            if not rest:
                return None
            value = rest.pop(0)
        if name in _VALUED_OPTIONS:
            if name == "--home":
                home = value
        elif token.startswith("-"):
            return None  # --help and anything else: the full command line's business
        else:
            positional += 1
    return Path(home) if positional == 1 else None
