"""What a launcher refuses to send, raised at once by a run and listed in full by a dry run.

A backend's ``render`` checks what the platform could not run: a path the pods or the training job
would not see, no instance type, a parameter name the container reserves. A run (``submit``) must stop
at the first such problem, before anything is written. A dry run (``tunepod render``) must show the
payload anyway, then every problem, as ``kubectl apply --dry-run=server`` shows the object and its
errors: a person finds out what is wrong in one go.

So a renderer calls ``refuse(message)`` and carries on with what it would have sent had the check
passed (the path as it is, a placeholder). ``refuse`` raises ``TunepodError`` unless the caller
renders inside ``collecting()``, which gathers the messages instead. The collector lives in a context
variable, not a parameter: every render function a backend composes would otherwise pass it down, and
the threads of a run never enter ``collecting()``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from tunepod.errors import TunepodError

_collected: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("refusals", default=None)


def refuse(message: str) -> None:
    """Refuse the job being rendered for ``message`` (what is wrong, and the fix): raise
    ``TunepodError``, or, inside ``collecting()``, record it and return so the render goes on."""
    found = _collected.get()
    if found is None:
        raise TunepodError(message)
    if message not in found:
        found.append(message)


@contextlib.contextmanager
def collecting() -> Iterator[list[str]]:
    """Within the block, ``refuse`` records its messages in the list this yields, in order, once each."""
    found: list[str] = []
    token = _collected.set(found)
    try:
        yield found
    finally:
        _collected.reset(token)
