"""A hook's allow list: which S3 objects a delivery may name, how keys are matched, and the configuration
that declares it (refused at load where a hook needs one and lacks it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tunepod.webhook.allowlist import AllowedPrefix, Allowlist, has_dot_segment
from tunepod.webhook.config import WebhookConfigError, parse_webhook_config

ALLOW = Allowlist("s3eb", (AllowedPrefix("data", "raw/"), AllowedPrefix("archive", "")))
SPEC = "examples/digits/pipeline.yaml"
KEY = "eventbridge-connection-key-0123456789"
S3_SOURCE = "steps.data.with.source=s3://{payload.detail.bucket.name}/{payload.detail.object.key|dirname}"


def event(bucket: Any, key: Any) -> dict[str, Any]:
    """An EventBridge "Object Created" event naming ``bucket`` and ``key``."""
    return {"detail": {"bucket": {"name": bucket}, "object": {"key": key}}}


def notification(*objects: tuple[str, str]) -> dict[str, Any]:
    """An S3 event notification naming each ``(bucket, key)``."""
    records = [{"s3": {"bucket": {"name": bucket}, "object": {"key": key}}} for bucket, key in objects]
    return {"Records": records}


# ---------------------------------------------------------------------------------------------- matching


def test_a_prefix_matches_its_folder_and_not_a_sibling_that_shares_its_letters() -> None:
    assert ALLOW.body_problem(event("data", "raw/2024/train.npz")) is None
    assert ALLOW.body_problem(event("archive", "anything/at/all")) is None  # prefix "": the whole bucket
    for bucket, key in [("data", "raw-evil/x"), ("data", "rawx"), ("data", "raw"), ("data", "poison/raw/x")]:
        problem = ALLOW.body_problem(event(bucket, key))
        assert problem is not None and "outside hook s3eb's allow list" in problem, key


def test_the_bucket_must_be_one_listed_exactly() -> None:
    for bucket in ["attacker-bucket", "data-evil", "DATA", "dat", "data/raw", " data"]:
        problem = ALLOW.body_problem(event(bucket, "raw/x"))
        assert problem is not None and "add its bucket and prefix to hooks.s3eb.allow" in problem, bucket


@pytest.mark.parametrize(
    "key",
    [
        "raw/../poison/x",
        "raw/./x",
        "raw/..",
        "raw/%2e%2e/poison/x",
        "raw/%2E%2E/poison/x",
        "raw%2F..%2Fpoison%2Fx",
        "raw/%252e%252e/poison/x",  # decoded twice
        "raw\\..\\poison\\x",
        "raw/..%5Cpoison",
    ],
)
def test_a_key_with_a_dot_segment_is_refused_as_sent_or_decoded(key: str) -> None:
    assert has_dot_segment(key)
    problem = ALLOW.body_problem(event("data", key))
    assert problem is not None and "'.' or '..' segment" in problem


@pytest.mark.parametrize("key", ["raw/..x/y", "raw/a..b", "raw/.hidden", "raw/...", "raw/v1.2/x"])
def test_dots_inside_a_segment_are_ordinary_characters(key: str) -> None:
    assert not has_dot_segment(key)
    assert ALLOW.body_problem(event("data", key)) is None


def test_a_body_key_is_compared_url_decoded_as_s3_sends_it() -> None:
    # moto encodes '/' too, S3 encodes a space as '+': both are under raw/ once decoded.
    assert ALLOW.body_problem(notification(("data", "raw%2Fv+2%2Ftrain.npz"))) is None
    assert ALLOW.body_problem(notification(("data", "raw/v+2/train.npz"))) is None
    problem = ALLOW.body_problem(notification(("data", "raw-evil%2Ftrain.npz")))
    assert problem is not None and "outside" in problem


def test_a_url_an_override_built_is_compared_as_written() -> None:
    """What the stage step lists is the URL as the override wrote it: ``ra%77/`` is another folder than
    ``raw/`` in S3, though it decodes to it, and ``s3://data/`` is the whole bucket."""
    assert ALLOW.overrides_problem([(0, 'a.source="s3://data/raw/2024/"')]) is None
    for url in ["s3://data/ra%77/", "s3://data/", "s3://data/raw/../poison/", "s3://attacker-bucket/raw/"]:
        problem = ALLOW.overrides_problem([(2, f'a.source="{url}"')])
        assert problem is not None and problem.startswith("overrides[2] names"), url
    assert ALLOW.overrides_problem([(0, "a.n=3"), (1, 'a.tag="not-a-url"'), (2, "a.b=s3-ish")]) is None


def test_every_object_a_body_names_must_be_allowed_and_it_must_name_one() -> None:
    mixed = notification(("data", "raw/a"), ("attacker-bucket", "poison/b"))
    assert "payload.Records[1].s3 names 's3://attacker-bucket/poison/b'" in str(ALLOW.body_problem(mixed))
    both = {**event("data", "raw/a"), **notification(("attacker-bucket", "poison/b"))}
    assert ALLOW.body_problem(both) is not None
    for body in [{}, [], "text", {"detail": "x"}, {"Records": "x"}]:
        assert "the body names no S3 object" in str(ALLOW.body_problem(body)), body
    for body in [event(None, "raw/x"), event("data", 3), {"detail": {}}, {"Records": [{"s3": {}}]}]:
        assert "must name an S3 object: its bucket and key as text" in str(ALLOW.body_problem(body)), body


def test_a_message_escapes_and_shortens_what_the_body_wrote() -> None:
    problem = str(ALLOW.body_problem(event("attacker-bucket", "poison/\nINFO: forged line" + "x" * 500)))
    assert "\n" not in problem and "poison/\\nINFO: forged line" in problem
    assert len(problem) < 500


# ---------------------------------------------------------------------------------------------- config


def hooks(**hook: Any) -> dict[str, Any]:
    return {"hooks": {"s3eb": {"spec": SPEC, "scheme": "eventbridge", "secrets": [{"env": "KEY"}], **hook}}}


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(WebhookConfigError) as raised:
        parse_webhook_config(data, "hooks.yaml", {"KEY": KEY})
    return raised.value.problems


def test_an_eventbridge_hook_without_an_allow_list_does_not_load(in_repo: Path) -> None:
    assert problems(hooks(overrides=[S3_SOURCE])) == [
        "hooks.s3eb.allow: missing; an eventbridge hook's API key is a bearer credential (whoever holds "
        "it can post any event, naming any bucket). List the S3 buckets and key prefixes its deliveries "
        "may name, e.g. allow: [{bucket: my-data, prefix: digits/}]"
    ]


def test_a_signed_hook_that_builds_an_s3_url_from_the_payload_needs_an_allow_list(in_repo: Path) -> None:
    data = hooks(scheme="standard", overrides=["a.b=1", S3_SOURCE])
    assert problems(data) == [
        "hooks.s3eb.allow: missing; overrides[1] builds an s3:// URL from the payload: a delivery picks "
        "the data. List the S3 buckets and key prefixes its deliveries may name, e.g. allow: "
        "[{bucket: my-data, prefix: digits/}]"
    ]
    # A fixed s3:// URL, or placeholders elsewhere, leave the choice of data to the configuration.
    fixed = hooks(scheme="standard", overrides=["a.src=s3://data/raw/", "a.n={payload.n}"])
    assert parse_webhook_config(fixed, "hooks.yaml", {"KEY": KEY}).hooks["s3eb"].allow is None


def test_an_allow_list_loads_into_the_hook(in_repo: Path) -> None:
    data = hooks(overrides=[S3_SOURCE], allow=[{"bucket": "data", "prefix": "raw/"}, {"bucket": "archive"}])
    hook = parse_webhook_config(data, "hooks.yaml", {"KEY": KEY}).hooks["s3eb"]
    assert hook.allow == Allowlist("s3eb", (AllowedPrefix("data", "raw/"), AllowedPrefix("archive", "")))
    assert hook.forbidden_body(event("data", "raw/x/y.npz")) is None
    assert hook.forbidden_overrides(hook.render_overrides(event("data", "raw/x/y.npz"))) is None
    assert "outside" in str(hook.forbidden_body(event("attacker-bucket", "poison/x")))


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            {"bucket": "data", "prefix": "raw"},
            "hooks.s3eb.allow[0].prefix: 'raw' does not end with '/', so it would also match "
            "'raw-other/'; write 'raw/' (a folder)",
        ),
        (
            {"bucket": "data", "prefix": "/raw/"},
            "hooks.s3eb.allow[0].prefix: '/raw/' has an empty segment; S3 keys start without '/': "
            "write it like digits/v2/",
        ),
        (
            {"bucket": "data", "prefix": "raw/../"},
            "hooks.s3eb.allow[0].prefix: 'raw/../' has a '.' or '..' segment, which no allowed key may "
            "have; write the folder plainly",
        ),
        (
            {"bucket": "s3://data/raw/"},
            "hooks.s3eb.allow[0].bucket: 's3://data/raw/' is not an S3 bucket name; write the bare name "
            "(letters, digits, '.', '-', '_'), like my-data, with the folder in prefix:",
        ),
        (
            {"bucket": "data", "prefixes": "raw/"},
            "hooks.s3eb.allow[0].prefixes: unknown key; valid keys: bucket, prefix",
        ),
    ],
)
def test_an_allow_entry_that_would_match_more_than_it_says_does_not_load(
    in_repo: Path, entry: dict[str, str], expected: str
) -> None:
    assert problems(hooks(overrides=[S3_SOURCE], allow=[entry])) == [expected]


def test_an_empty_allow_list_does_not_load(in_repo: Path) -> None:
    [problem] = problems(hooks(overrides=[S3_SOURCE], allow=[]))
    assert problem.startswith("hooks.s3eb.allow: List should have at least 1 item")


def test_an_override_that_reads_the_bucket_elsewhere_is_checked_as_it_fills(in_repo: Path) -> None:
    """The body's object may be allowed while the override stages another field's bucket: what the run
    would stage is checked too."""
    other = "steps.data.with.source=s3://{payload.detail.requester}/{payload.detail.object.key|dirname}"
    data = hooks(overrides=[other], allow=[{"bucket": "data", "prefix": "raw/"}])
    hook = parse_webhook_config(data, "hooks.yaml", {"KEY": KEY}).hooks["s3eb"]
    body = event("data", "raw/x/y.npz")
    body["detail"]["requester"] = "attacker-bucket"
    assert hook.forbidden_body(body) is None
    assert str(hook.forbidden_overrides(hook.render_overrides(body))).startswith(
        "overrides[0] names 's3://attacker-bucket/raw/x/'"
    )
