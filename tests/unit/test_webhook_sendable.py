"""What Prefect can take of an event's payload (``tunepod.webhook.sendable``) and how an event is
encoded for it (``events.encode_event``): each problem named by its path, with its fix, in ASCII."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tunepod.webhook.events import EventUnsendable, OutgoingEvent, encode_event, hook_resource
from tunepod.webhook.sendable import MAX_EVENT_BYTES, payload_problem


def nested(levels: int, inside: Any = 1) -> Any:
    value = inside
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    "payload",
    [
        {
            "emoji": json.loads('"\\ud83d\\ude00"'),  # a pair in JSON is one character, U+1F600
            "text": "caf\u00e9 \u2028",
            "big": 10**400,
            "tiny": 1e-400,
            "max": 1.7e308,
        },
        nested(7, {}),
        "plain",
        None,
        {"": [], "a.b": {"c": [True, None, 0]}},
    ],
)
def test_json_prefect_takes_has_no_problem(payload: Any) -> None:
    assert payload_problem(payload, "payload", 8) is None


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ({"a": [1, {"b": float("-inf")}]}, "payload.a[1].b is a number beyond a 64-bit float"),
        (float("inf"), "payload is a number beyond a 64-bit float"),
        ({"a": ["ok", "x\udfff"]}, "payload.a[1] holds a lone UTF-16 surrogate (\\udfff)"),
        ({"a": {"k\ud800": 1}}, 'the key "k\\ud800" in payload.a holds a lone UTF-16 surrogate'),
        ({"odd key": {"b": "\x00"}}, 'payload["odd key"].b holds U+0000 (NUL)'),
    ],
)
def test_a_problem_names_its_path_in_ascii(payload: Any, problem: str) -> None:
    found = payload_problem(payload, "payload")
    assert found is not None and found.startswith(problem), found
    assert found.isascii()


def test_nesting_is_counted_in_lists_and_objects_empty_ones_included() -> None:
    assert payload_problem(nested(8), "payload", 8) is None
    assert payload_problem(nested(7, {}), "payload", 8) is None
    for too_deep in (nested(9), nested(8, []), nested(8, {})):
        problem = payload_problem(too_deep, "payload", 8)
        assert problem is not None and "nests lists and objects more than 8 deep" in problem


def test_a_body_as_deep_as_the_json_parser_reads_is_walked_without_recursion() -> None:
    deepest = json.loads("[" * 900 + "]" * 900)
    problem = payload_problem(deepest, "payload", 128)
    assert problem is not None and problem.endswith("or send the deep part as a string")
    assert len(problem) < 600  # the path is cut short, not 900 indexes long


def test_encode_event_writes_what_prefect_reads_and_refuses_what_it_drops() -> None:
    event = OutgoingEvent("id-1", "tunepod.webhook.x", hook_resource("x"), {"body": {"t": "caf\u00e9"}})
    encoded = encode_event(event, "2026-01-01T00:00:00+00:00")
    assert json.loads(encoded)["payload"] == {"body": {"t": "caf\u00e9"}}
    assert "caf\u00e9".encode() in encoded  # UTF-8, as Prefect's server writes it again
    # 1e15 is 4 bytes in a body and 18 as Prefect writes it: the size is measured the way Prefect does.
    long_numbers = OutgoingEvent("id-2", "tunepod.webhook.x", hook_resource("x"), {"n": [1e15] * 80_000})
    with pytest.raises(EventUnsendable, match=f"over the {MAX_EVENT_BYTES:,} it keeps") as raised:
        encode_event(long_numbers, "2026-01-01T00:00:00+00:00")
    assert str(raised.value).startswith("event id-2 cannot be sent to Prefect: the event is 1,")
    surrogate = OutgoingEvent("id-3", "tunepod.webhook.x", hook_resource("x"), {"body": "\ud800"})
    with pytest.raises(EventUnsendable, match=r"payload\.body holds a lone UTF-16 surrogate"):
        encode_event(surrogate, "2026-01-01T00:00:00+00:00")
