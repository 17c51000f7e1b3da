"""The local stack's runner process (``tunepod up`` starts it): import once, fork per ``tunepod run``.

    python -m flows.runner --home .tunepod

See ``tunepod.stack.runner`` for what it does and when it refuses a run.
"""

from __future__ import annotations

import argparse
import gc
import logging
from functools import partial
from pathlib import Path

# What a `tunepod run` imports on its way to its first job, imported once here. Prefect reads its
# settings now, from this process's environment: the runner forks only for callers whose Prefect and
# MLflow variables are the same.
import mlflow.tracking  # noqa: F401
import optuna  # noqa: F401
import sklearn.datasets  # noqa: F401  # the builtin digits stage

import flows.pipeline
import tasks
import tunepod
from tunepod.cli import app
from tunepod.stack.manage import running_prefect_api
from tunepod.stack.runner import Runner, SourceSnapshot
from tunepod.stack.watch import run_environment_defaults

SOURCE_ROOTS = [Path(package.__file__).parent for package in (tunepod, flows, tasks) if package.__file__]


def run_command(argv: list[str]) -> None:
    """Run ``tunepod <argv>`` in the child; the CLI ends it with ``SystemExit``."""
    app(args=argv, prog_name="tunepod")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, required=True, help="The stack's state folder.")
    home = parser.parse_args().home
    # Its lines go out through the handler Prefect's logging set-up put on the root logger.
    logging.getLogger("tunepod.stack.runner").setLevel(logging.INFO)
    sources = SourceSnapshot.of_loaded_modules(SOURCE_ROOTS)
    # What is imported now lives as long as the process: out of the collector's sight, a child's
    # collections skip it and do not touch (copy) its pages, and its exit does not sweep it (seconds).
    gc.freeze()
    stack_api = partial(running_prefect_api, home)
    Runner(home, run_command, sources, stack_api, run_environment_defaults()).serve_forever()


if __name__ == "__main__":
    main()
