"""Retry only what a retry can fix (see ``tunepod.errors.is_transient``)."""

from __future__ import annotations

from typing import Any

from tunepod.errors import is_transient


def transient_only(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry a failed task only when its exception is transient."""
    exc = state.result(raise_on_failure=False)
    return isinstance(exc, BaseException) and is_transient(exc)
