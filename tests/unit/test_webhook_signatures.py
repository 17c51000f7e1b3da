"""Webhook signatures: the published test vectors, rotation, whsec secrets, timestamps, GitHub."""

from __future__ import annotations

import hmac

import pytest

from tunepod.webhook import signatures
from tunepod.webhook.signatures import (
    API_KEY_HEADER,
    TOLERANCE_S,
    SecretFormatError,
    SignatureError,
    check_event_time,
    check_github_push_age,
    eventbridge_dedupe_key,
    github_dedupe_key,
    github_headers,
    new_standard_secret,
    sign_github,
    sign_standard,
    standard_headers,
    standard_key,
    verify_api_key,
    verify_github,
    verify_standard,
)

# The Standard Webhooks specification's own example (standard-webhooks/libraries test suites).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

BODY = b'{"ref": "refs/heads/main"}'
NOW = 1_700_000_000


def spec_headers(signature: str = SPEC_SIGNATURE, timestamp: int = SPEC_TIMESTAMP) -> dict[str, str]:
    return {"webhook-id": SPEC_ID, "webhook-timestamp": str(timestamp), "webhook-signature": signature}


def test_the_standard_webhooks_example_signs_and_verifies() -> None:
    assert sign_standard(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE
    assert verify_standard([SPEC_SECRET], spec_headers(), SPEC_BODY, now=SPEC_TIMESTAMP) == SPEC_ID


def test_githubs_documented_example_signs_and_verifies() -> None:
    # From GitHub's "Validating webhook deliveries" page.
    secret, body = "It's a Secret to Everybody", b"Hello, World!"
    expected = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert sign_github(secret, body) == expected
    headers = {"X-Hub-Signature-256": expected, "X-GitHub-Delivery": "d-1"}
    assert verify_github([secret], headers, body) == "d-1"


def test_header_names_are_case_insensitive() -> None:
    upper = {name.upper(): value for name, value in spec_headers().items()}
    assert verify_standard([SPEC_SECRET], upper, SPEC_BODY, now=SPEC_TIMESTAMP) == SPEC_ID
    github = {name.lower(): value for name, value in github_headers("s", BODY, delivery_id="d").items()}
    assert verify_github(["s"], github, BODY) == "d"


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        (SPEC_BODY + b" ", spec_headers()),  # body changed after signing
        (SPEC_BODY, {**spec_headers(), "webhook-id": "msg_other"}),  # id is signed too
        (SPEC_BODY, spec_headers(signature="v1,AAAA" + SPEC_SIGNATURE[7:])),
        (SPEC_BODY, spec_headers(signature="v2," + SPEC_SIGNATURE[3:])),  # only v1 counts
        (SPEC_BODY, spec_headers(signature=SPEC_SIGNATURE[3:])),  # no version prefix
    ],
    ids=["body", "id", "signature", "version", "no-version"],
)
def test_a_tampered_standard_request_is_rejected(body: bytes, headers: dict[str, str]) -> None:
    with pytest.raises(SignatureError):
        verify_standard([SPEC_SECRET], headers, body, now=SPEC_TIMESTAMP)


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_a_missing_standard_header_is_named(missing: str) -> None:
    headers = {name: value for name, value in spec_headers().items() if name != missing}
    with pytest.raises(SignatureError, match=f"missing header {missing}"):
        verify_standard([SPEC_SECRET], headers, SPEC_BODY, now=SPEC_TIMESTAMP)


def test_the_wrong_github_secret_or_body_is_rejected() -> None:
    headers = github_headers("right", BODY)
    with pytest.raises(SignatureError, match="none of the hook's secrets"):
        verify_github(["wrong"], headers, BODY)
    with pytest.raises(SignatureError):
        verify_github(["right"], headers, BODY + b"\n")
    with pytest.raises(SignatureError, match="missing header X-Hub-Signature-256"):
        verify_github(["right"], {"X-GitHub-Delivery": "d"}, BODY)


def test_rotation_accepts_any_active_secret_and_any_listed_signature() -> None:
    old, new = new_standard_secret(), new_standard_secret()
    signed_old = standard_headers([old], BODY, timestamp=NOW)
    signed_new = standard_headers([new], BODY, timestamp=NOW)
    # The receiver lists both secrets while the sender moves from the old one to the new one.
    assert verify_standard([old, new], signed_old, BODY, now=NOW)
    assert verify_standard([old, new], signed_new, BODY, now=NOW)
    # A sender rotating signs with both; a receiver that knows only one of them accepts.
    signed_both = standard_headers([old, new], BODY, timestamp=NOW)
    assert len(signed_both["webhook-signature"].split()) == 2
    assert verify_standard([new], signed_both, BODY, now=NOW)
    with pytest.raises(SignatureError):
        verify_standard([new_standard_secret()], signed_both, BODY, now=NOW)
    # GitHub has one secret per hook; rotating there means the receiver lists old and new.
    assert verify_github(["old", "new"], github_headers("new", BODY, delivery_id="x"), BODY) == "x"


def test_whsec_secrets_are_base64_keys_and_other_strings_are_their_bytes() -> None:
    assert standard_key("whsec_aGVsbG8=") == b"hello"
    assert standard_key("hello") == b"hello"
    assert sign_standard("whsec_aGVsbG8=", "m", NOW, BODY) == sign_standard("hello", "m", NOW, BODY)
    with pytest.raises(SecretFormatError) as raised:
        standard_key("whsec_not*base64")
    assert "not*base64" not in str(raised.value)


@pytest.mark.parametrize("skew_s", [TOLERANCE_S, -TOLERANCE_S, 0])
def test_a_timestamp_within_five_minutes_either_side_is_accepted(skew_s: int) -> None:
    headers = standard_headers(["s"], BODY, timestamp=NOW + skew_s)
    assert verify_standard(["s"], headers, BODY, now=NOW)


@pytest.mark.parametrize("skew_s", [TOLERANCE_S + 1, -TOLERANCE_S - 1, 86_400])
def test_a_timestamp_further_than_five_minutes_is_rejected(skew_s: int) -> None:
    headers = standard_headers(["s"], BODY, timestamp=NOW + skew_s)
    with pytest.raises(SignatureError, match="away from the receiver's clock"):
        verify_standard(["s"], headers, BODY, now=NOW)


@pytest.mark.parametrize("timestamp", ["soon", "1.5e9", "-1", "", "\u0661\u0662"])
def test_a_timestamp_that_is_not_whole_seconds_is_rejected(timestamp: str) -> None:
    headers = {**standard_headers(["s"], BODY, timestamp=NOW), "webhook-timestamp": timestamp}
    with pytest.raises(SignatureError):
        verify_standard(["s"], headers, BODY, now=NOW)


def test_non_ascii_signature_headers_are_rejected_not_crashed_on() -> None:
    headers = {**standard_headers(["s"], BODY, timestamp=NOW), "webhook-signature": "v1,\u00e9\u00e9"}
    with pytest.raises(SignatureError):
        verify_standard(["s"], headers, BODY, now=NOW)
    with pytest.raises(SignatureError):
        verify_github(["s"], {"X-Hub-Signature-256": "sha256=\u00e9", "X-GitHub-Delivery": "d"}, BODY)


def test_errors_never_contain_the_secret_or_the_expected_signature() -> None:
    secret = new_standard_secret()
    headers = standard_headers(["the-senders-secret"], BODY, timestamp=NOW)
    expected = sign_standard(secret, headers["webhook-id"], NOW, BODY)
    with pytest.raises(SignatureError) as raised:
        verify_standard([secret], headers, BODY, now=NOW)
    assert secret not in str(raised.value)
    assert expected.removeprefix("v1,") not in str(raised.value)


def test_every_signature_comparison_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Signatures are compared only through hmac.compare_digest (a spy around the real function)."""
    compared: list[tuple[bytes, bytes]] = []
    real_compare = hmac.compare_digest

    def recording_compare(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real_compare(a, b)

    monkeypatch.setattr(signatures.hmac, "compare_digest", recording_compare)
    headers = standard_headers(["one", "two"], BODY, timestamp=NOW)
    verify_standard(["other", "two"], headers, BODY, now=NOW)
    # Each received v1 signature is compared with the first secret's, then the second's (which matches).
    assert len(compared) == 4
    received = {value.removeprefix("v1,").encode() for value in headers["webhook-signature"].split()}
    assert {b for _, b in compared} == received
    compared.clear()
    with pytest.raises(SignatureError):
        verify_github(["a", "b"], github_headers("c", BODY), BODY)
    assert [a for a, _ in compared] == [sign_github("a", BODY).encode(), sign_github("b", BODY).encode()]


def test_a_github_delivery_is_deduplicated_by_its_signed_body_not_its_delivery_id() -> None:
    first = github_headers("s", BODY, delivery_id="d-1")
    replayed = {**first, "X-GitHub-Delivery": "d-2"}  # the header is not signed: a replay may pick any
    assert verify_github(["s"], replayed, BODY) == "d-2"
    assert github_dedupe_key(BODY) == github_dedupe_key(BODY)  # same body, same key, whatever the header
    assert github_dedupe_key(BODY) != github_dedupe_key(BODY + b" ")
    assert github_dedupe_key(BODY).startswith("sha256:")


WINDOW_S = 86_400 - TOLERANCE_S


def push(pushed_at: object) -> dict[str, object]:
    return {"ref": "refs/heads/main", "repository": {"name": "r", "pushed_at": pushed_at}}


@pytest.mark.parametrize("age_s", [0, WINDOW_S, -TOLERANCE_S])
def test_a_push_within_the_window_passes(age_s: int) -> None:
    check_github_push_age(push(NOW - age_s), WINDOW_S, now=NOW)


@pytest.mark.parametrize(
    ("age_s", "message"),
    [(WINDOW_S + 1, "refused as a possible replay"), (-TOLERANCE_S - 1, "ahead of the receiver's clock")],
)
def test_a_push_older_than_the_window_or_from_the_future_is_refused(age_s: int, message: str) -> None:
    with pytest.raises(SignatureError, match=message):
        check_github_push_age(push(NOW - age_s), WINDOW_S, now=NOW)


@pytest.mark.parametrize(
    "payload",
    [push("2020-01-01T00:00:00Z"), push(None), push(True), {"repository": "r"}, {"zen": "ping"}, [1], "x"],
    ids=["text", "null", "bool", "no-mapping", "no-repository", "list", "string"],
)
def test_a_body_without_a_push_time_is_not_dated(payload: object) -> None:
    # Only push events write pushed_at as epoch seconds; elsewhere it dates the repository, not the event.
    check_github_push_age(payload, WINDOW_S, now=NOW)


# ---------------------------------------------------------------------------------------------- EventBridge

API_KEY = "k" * 12 + "0123456789ab"
# An S3 "Object Created" event as EventBridge sends it (the shape of the S3 user guide's example).
S3_EVENT = {
    "version": "0",
    "id": "17793124-05d4-b198-2fde-7ededc63b103",
    "detail-type": "Object Created",
    "source": "aws.s3",
    "account": "111122223333",
    "time": "2021-11-12T00:00:00Z",
    "region": "ca-central-1",
    "resources": ["arn:aws:s3:::example-bucket"],
    "detail": {
        "version": "0",
        "bucket": {"name": "example-bucket"},
        "object": {"key": "example-key", "size": 5, "etag": "b1946ac92492d2347c6235b4d2611184"},
        "request-id": "N4N7GDK58NMKJ12R",
        "requester": "123456789012",
        "source-ip-address": "1.2.3.4",
        "reason": "PutObject",
    },
}
S3_EVENT_TIME = 1_636_675_200  # 2021-11-12T00:00:00Z


def test_an_api_key_verifies_in_any_case_of_its_header_and_any_rotation_slot() -> None:
    verify_api_key([API_KEY], {API_KEY_HEADER: API_KEY})
    verify_api_key(["an-older-key-still-listed-xx", API_KEY], {API_KEY_HEADER.lower(): API_KEY})


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({}, "missing header X-Tunepod-Key"),
        ({API_KEY_HEADER: API_KEY + "x"}, "X-Tunepod-Key matches none of the hook's keys"),
        ({API_KEY_HEADER: API_KEY[:-1]}, "X-Tunepod-Key matches none of the hook's keys"),
        ({"Authorization": f"Bearer {API_KEY}"}, "missing header X-Tunepod-Key"),
    ],
)
def test_a_wrong_or_missing_api_key_is_refused_without_showing_it(
    headers: dict[str, str], message: str
) -> None:
    with pytest.raises(SignatureError, match=message) as raised:
        verify_api_key([API_KEY], headers)
    assert API_KEY not in str(raised.value)


def test_an_eventbridge_event_is_deduplicated_by_its_own_id() -> None:
    assert eventbridge_dedupe_key(S3_EVENT) == "eventbridge:17793124-05d4-b198-2fde-7ededc63b103"
    for body in ({"detail": {}}, {"id": ""}, {"id": 7}, ["id"]):
        with pytest.raises(SignatureError, match="an EventBridge event names itself in 'id'"):
            eventbridge_dedupe_key(body)


def test_an_event_older_than_the_dedupe_window_or_ahead_of_the_clock_is_refused() -> None:
    window = 24 * 3600 - TOLERANCE_S
    check_event_time(S3_EVENT, window, now=S3_EVENT_TIME + window - 1)
    check_event_time(S3_EVENT, window, now=S3_EVENT_TIME - TOLERANCE_S + 1)  # a sender's clock a little ahead
    with pytest.raises(SignatureError, match=r"happened 86101 s ago .* refused as a possible replay"):
        check_event_time(S3_EVENT, window, now=S3_EVENT_TIME + window + 1)
    with pytest.raises(SignatureError, match=r"301 s ahead of the receiver's clock"):
        check_event_time(S3_EVENT, window, now=S3_EVENT_TIME - TOLERANCE_S - 1)
    for when in (None, 1636675200, "yesterday"):
        with pytest.raises(SignatureError, match=r"says when it happened in 'time' \(ISO 8601\)"):
            check_event_time({**S3_EVENT, "time": when}, window, now=S3_EVENT_TIME)
