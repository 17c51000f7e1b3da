"""What Prefect can take and keep of an event: checked before the receiver accepts a delivery (422
otherwise) and again, through ``events.encode_event``, before the publisher sends an event (one that
fails is set aside, never retried).

JSON that Python reads is not always JSON that reaches a run. Each of these was once accepted (202)
and then never started one:

- a number beyond a 64-bit float (``1e400`` reads as infinity): it cannot be written back as JSON;
- a lone UTF-16 surrogate (``"\\ud800"`` without its pair), in a key or a value: it is not Unicode
  text, so it cannot be sent as UTF-8;
- U+0000 (``"\\u0000"``): PostgreSQL, Prefect's production database, cannot store it in JSON, and
  Prefect's event writer drops the whole batch it came in after five failed tries;
- lists and objects nested deeper than ``MAX_PAYLOAD_DEPTH``: Prefect's server reads every event back
  with pydantic, whose JSON parser stops at 200 levels (Prefect answers 204 and drops the event;
  past 254 levels it answers 500, which looks like an outage and was retried forever);
- an event longer than ``MAX_EVENT_BYTES`` as pydantic writes it: Prefect answers 204 and drops an
  event over ``PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES`` (1,500,000 by default). Under the receiver's
  1 MiB body limit only numbers grow that far: written out in full, ``1e15`` is ``1000000000000000.0``.

Pure functions; the path a problem names is written the way hook overrides address a payload
(``payload.commits[0].message``), in ASCII whatever the keys hold.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeAlias

MAX_PAYLOAD_DEPTH = 129
"""Lists and objects nested in an event's payload, the payload counted. Prefect reads an event back
with pydantic, which stops at 200 levels; the payload starts one level into the event."""
MAX_BODY_DEPTH = MAX_PAYLOAD_DEPTH - 1
"""The same for a delivery's body, which an event carries one level inside its payload."""
MAX_EVENT_BYTES = 1_400_000
"""Prefect's default ``PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES`` (1,500,000), less room for what its
server adds to an event (``received``, ``follows``)."""

_UNSENDABLE_CHARACTER = re.compile("[\x00\ud800-\udfff]")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SHOWN_KEY_CHARS = 40
_SHOWN_PATH_CHARS = 160

# A path from the value checked to one inside it, as a linked list (parent, segment): one tuple per
# container visited, and the text is only written for the problem found.
_Path: TypeAlias = "tuple[_Path, str | int] | None"


def payload_problem(value: Any, where: str, max_depth: int = MAX_PAYLOAD_DEPTH) -> str | None:
    """What in ``value`` (parsed JSON) Prefect could never take, naming its path from ``where`` and the
    fix; None when there is nothing. ``max_depth``: the most lists and objects nested in ``value``,
    ``value`` itself counted. Iterative, so a body nested as deep as the JSON parser allows is fine."""
    if not isinstance(value, dict | list):
        fault = _scalar_fault(value)
        return None if fault is None else f"{where} {fault}"
    pending: list[tuple[dict[str, Any] | list[Any], _Path, int]] = [(value, None, 1)]
    while pending:
        container, path, depth = pending.pop()
        if depth > max_depth:
            return (
                f"{_path_text(where, path)} nests lists and objects more than {max_depth} deep, deeper "
                "than Prefect reads an event back (its parser stops at 200 levels); flatten the JSON, or "
                "send the deep part as a string"
            )
        if isinstance(container, dict) and _UNSENDABLE_CHARACTER.search("".join(container)):
            return _keys_problem(container, path, where)
        # Once per value of a body of up to 1 MiB: exact types (what json.loads makes), and the path is
        # written only for a fault, since most values have none.
        for segment, child in container.items() if isinstance(container, dict) else enumerate(container):
            kind = type(child)
            if kind is dict or kind is list:
                if child or depth + 1 > max_depth:  # an empty one can only be too deep
                    pending.append((child, (path, segment), depth + 1))
            elif (kind is str and _UNSENDABLE_CHARACTER.search(child)) or (
                kind is float and not math.isfinite(child)
            ):
                return f"{_path_text(where, (path, segment))} {_scalar_fault(child)}"
    return None


def size_problem(encoded_bytes: int) -> str | None:
    """Why an event of ``encoded_bytes`` (as pydantic writes it) would be dropped by Prefect; None if not."""
    if encoded_bytes <= MAX_EVENT_BYTES:
        return None
    return (
        f"the event is {encoded_bytes:,} bytes as Prefect writes it, over the {MAX_EVENT_BYTES:,} it keeps "
        "(it drops larger events); numbers grow there (1e15 is written 1000000000000000.0): send a "
        "smaller body, or long runs of numbers as strings"
    )


def _scalar_fault(value: Any) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return (
            "is a number beyond a 64-bit float (such as 1e400 or -1e400), which cannot be written back "
            "as JSON; send it as a string"
        )
    if isinstance(value, str):
        problem = _text_problem(value)
        if problem is not None:
            return f"holds {problem}"
    return None


def _keys_problem(mapping: dict[str, Any], path: _Path, where: str) -> str:
    """The problem of the first key of ``mapping`` that holds a character Prefect cannot take."""
    key = next(key for key in mapping if _UNSENDABLE_CHARACTER.search(key))
    return f"the key {_shown_key(key)} in {_path_text(where, path)} holds {_text_problem(key)}"


def _text_problem(text: str) -> str | None:
    found = _UNSENDABLE_CHARACTER.search(text)
    if found is None:
        return None
    if found.group() == "\x00":
        return (
            "U+0000 (NUL), which Prefect cannot store on PostgreSQL; remove it, or send binary data "
            "base64-encoded"
        )
    return (
        f"a lone UTF-16 surrogate ({_shown_key(found.group())[1:-1]}), which is not Unicode text and "
        "cannot be sent as UTF-8; escape a character beyond U+FFFF as a surrogate pair "
        "(\\ud83d\\ude00), or send binary data base64-encoded"
    )


def _path_text(where: str, path: _Path) -> str:
    segments: list[str | int] = []
    while path is not None:
        path, segment = path
        segments.append(segment)
    text = where + "".join(_segment_text(segment) for segment in reversed(segments))
    return text if len(text) <= _SHOWN_PATH_CHARS else text[:_SHOWN_PATH_CHARS] + "..."


def _segment_text(segment: str | int) -> str:
    if isinstance(segment, int):
        return f"[{segment}]"
    return f".{segment}" if _PLAIN_KEY.fullmatch(segment) else f"[{_shown_key(segment)}]"


def _shown_key(key: str) -> str:
    """``key`` as a JSON string in ASCII (a surrogate or NUL escaped), cut to a readable length."""
    shown = json.dumps(key[:_SHOWN_KEY_CHARS])
    return shown if len(key) <= _SHOWN_KEY_CHARS else shown[:-1] + '..."'
