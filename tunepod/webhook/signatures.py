"""Webhook signatures: Standard Webhooks (``webhook-*`` headers), GitHub (``X-Hub-Signature-256``), and
the API key of an Amazon EventBridge API destination (``X-Tunepod-Key``).

Pure functions, no I/O, safe to call from any thread. Signing is here too, so that ``tunepod webhook
sign`` and the tests produce exactly what a sender would.

Standard Webhooks (https://www.standardwebhooks.com): the sender signs ``"{id}.{timestamp}.{body}"``
with HMAC-SHA256 and sends ``webhook-signature: v1,<base64>``, several space-separated signatures when
it signs with more than one key. A secret written ``whsec_<base64>`` is that base64's bytes (the
spec's form); any other string is its own UTF-8 bytes. The timestamp must lie within
``TOLERANCE_S`` of the receiver's clock, on either side, which bounds how long a captured request
can be replayed.

GitHub: ``X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the body>``, keyed by the secret's UTF-8
bytes exactly as typed into GitHub (no ``whsec_`` decoding: GitHub does none). GitHub signs the body
only: neither ``X-GitHub-Delivery`` nor a timestamp. So the receiver deduplicates a GitHub delivery
by the digest of its body (``github_dedupe_key``), never by that header: a captured delivery sent
again under a new id is a duplicate, like GitHub's own Redeliver, which sends the same body. Its
dedupe entry lasts the receiver's dedupe window (24 h), and past it only a push carries a time to
bound replays with: ``repository.pushed_at``, when GitHub took the push (``check_github_push_age``
refuses a push older than the window; a commit's own ``timestamp`` is its author's clock and says
nothing about the push). A captured non-push delivery (no time of its own in the body) can be
replayed once its dedupe entry is gone: prefer the standard scheme where the sender offers it.

EventBridge: a rule's API destination sends each event (an S3 ``Object Created``, say) as its JSON
body, with the headers of its connection. EventBridge signs nothing; its connection sends a static
API key (``ApiKeyName: X-Tunepod-Key``) over HTTPS, which the receiver compares with the hook's keys.
The key is the whole secret, so a hook of this scheme refuses keys shorter than ``MIN_API_KEY_CHARS``.
The event carries its own ``id`` (one per event, kept by EventBridge's retries) and ``time``: the
receiver deduplicates by the id (``eventbridge_dedupe_key``) and refuses an event older than its
dedupe window or ahead of its clock (``check_event_time``), so that EventBridge's retries (24 hours
at most, the receiver's window) of an event start it once. That bounds copies of one event, not
forgeries: the key is a bearer credential that signs nothing, so whoever has seen one request can
post any body under a fresh ``id`` and ``time``. What such a body may name is bounded by the hook's
allow list of S3 buckets and prefixes (``allowlist``), which this scheme requires.

Every comparison of a computed signature with a received one goes through ``hmac.compare_digest``,
so the time taken does not reveal how many leading characters matched. Secrets never appear in the
messages of ``SignatureError``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from tunepod.errors import TunepodError

TOLERANCE_S = 5 * 60
WHSEC_PREFIX = "whsec_"

# Header names as they travel (HTTP header names are case-insensitive; lookups below lowercase them).
WEBHOOK_ID = "webhook-id"
WEBHOOK_TIMESTAMP = "webhook-timestamp"
WEBHOOK_SIGNATURE = "webhook-signature"
GITHUB_SIGNATURE = "X-Hub-Signature-256"
GITHUB_DELIVERY = "X-GitHub-Delivery"
API_KEY_HEADER = "X-Tunepod-Key"
MIN_API_KEY_CHARS = 24


class SignatureError(TunepodError):
    """A request whose signature is missing, malformed, stale or made with none of the hook's secrets.

    The message says which check failed (for the sender's logs); it never contains a secret or the
    signature the receiver expected.
    """


class SecretFormatError(TunepodError):
    """A ``whsec_`` secret whose remainder is not base64."""


# ---------------------------------------------------------------------------------------------- keys


def standard_key(secret: str) -> bytes:
    """The HMAC key of a Standard Webhooks secret: ``whsec_<base64>`` decoded, else the UTF-8 bytes."""
    if not secret.startswith(WHSEC_PREFIX):
        return secret.encode("utf-8")
    try:
        return base64.b64decode(secret.removeprefix(WHSEC_PREFIX), validate=True)
    except binascii.Error:
        # The secret itself must not reach the message: it would end up in startup logs.
        raise SecretFormatError("a whsec_ secret must be followed by base64 (its key bytes)") from None


def new_standard_secret() -> str:
    """A fresh random ``whsec_`` secret (24 key bytes, as the Standard Webhooks libraries generate)."""
    import secrets

    return WHSEC_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode("ascii")


# ---------------------------------------------------------------------------------------------- signing


def sign_standard(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value ``v1,<base64>`` of ``body`` sent as ``msg_id`` at ``timestamp``."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(standard_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode("ascii")


def sign_github(secret: str, body: bytes) -> str:
    """The ``X-Hub-Signature-256`` value ``sha256=<hex>`` of ``body``."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


def standard_headers(
    secrets: Iterable[str], body: bytes, *, msg_id: str | None = None, timestamp: int | None = None
) -> dict[str, str]:
    """The three Standard Webhooks headers of ``body``, signed with each of ``secrets``."""
    msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
    timestamp = int(time.time()) if timestamp is None else timestamp
    signatures = " ".join(sign_standard(secret, msg_id, timestamp, body) for secret in secrets)
    return {WEBHOOK_ID: msg_id, WEBHOOK_TIMESTAMP: str(timestamp), WEBHOOK_SIGNATURE: signatures}


def github_headers(secret: str, body: bytes, *, delivery_id: str | None = None) -> dict[str, str]:
    """The headers GitHub sends with ``body``: the delivery id and the signature."""
    return {GITHUB_DELIVERY: delivery_id or str(uuid.uuid4()), GITHUB_SIGNATURE: sign_github(secret, body)}


# ---------------------------------------------------------------------------------------------- verifying


def verify_standard(
    secrets: Iterable[str], headers: Mapping[str, str], body: bytes, *, now: float | None = None
) -> str:
    """Check a Standard Webhooks request; returns its ``webhook-id`` (the delivery id).

    Accepts when any ``v1`` signature in the header matches any of ``secrets`` (several secrets are
    how a hook rotates keys). Raises ``SignatureError`` otherwise, or when a header is missing, or when
    the timestamp is further than ``TOLERANCE_S`` from ``now`` (default: the current time).
    """
    lowered = _lowercase(headers)
    msg_id = _required(lowered, WEBHOOK_ID)
    timestamp = _timestamp(_required(lowered, WEBHOOK_TIMESTAMP), time.time() if now is None else now)
    versioned = (part.partition(",") for part in _required(lowered, WEBHOOK_SIGNATURE).split())
    received = [value.encode("utf-8", "replace") for version, _, value in versioned if version == "v1"]
    if not received:
        raise SignatureError(f"{WEBHOOK_SIGNATURE} has no v1 signature (expected 'v1,<base64>')")
    for secret in secrets:
        expected = sign_standard(secret, msg_id, timestamp, body).removeprefix("v1,").encode("ascii")
        if _any_matches(expected, received):
            return msg_id
    raise SignatureError(f"{WEBHOOK_SIGNATURE} matches none of the hook's secrets")


def verify_github(secrets: Iterable[str], headers: Mapping[str, str], body: bytes) -> str:
    """Check a GitHub request; returns its ``X-GitHub-Delivery`` id. Raises ``SignatureError``."""
    lowered = _lowercase(headers)
    received = _required(lowered, GITHUB_SIGNATURE).strip().encode("utf-8", "replace")
    delivery_id = _required(lowered, GITHUB_DELIVERY)
    for secret in secrets:
        if _any_matches(sign_github(secret, body).encode("ascii"), [received]):
            return delivery_id
    raise SignatureError(f"{GITHUB_SIGNATURE} matches none of the hook's secrets")


def github_dedupe_key(body: bytes) -> str:
    """What a GitHub delivery is deduplicated by: the SHA-256 of its body, which the signature covers.

    Two deliveries with one key are one event: a replay under a new ``X-GitHub-Delivery``, or GitHub's
    Redeliver. Two events GitHub sends differ in their bodies (each names its own ids and times).
    """
    return "sha256:" + hashlib.sha256(body).hexdigest()


def check_github_push_age(payload: Any, max_age_s: float, *, now: float | None = None) -> None:
    """Refuse a GitHub push whose ``repository.pushed_at`` is more than ``max_age_s`` before ``now``
    (default: the current time), or more than ``TOLERANCE_S`` after it: ``SignatureError``.

    A push event writes ``pushed_at`` as whole seconds since the epoch, when GitHub took the push;
    other events write the repository's last push there, as text, which dates nothing about them, so
    they pass unchecked. The receiver passes its dedupe window less ``TOLERANCE_S`` as ``max_age_s``:
    a push younger than that is still remembered if it was accepted, so a replay of it is a duplicate,
    and an older one is refused whatever it is.
    """
    repository = payload.get("repository") if isinstance(payload, dict) else None
    pushed_at = repository.get("pushed_at") if isinstance(repository, dict) else None
    if type(pushed_at) is not int:  # bool is an int subclass; JSON true is no time
        return
    age_s = (time.time() if now is None else now) - pushed_at
    if age_s > max_age_s:
        raise SignatureError(
            f"this GitHub push was made {int(age_s)} s ago (repository.pushed_at), more than the "
            f"{int(max_age_s)} s for which the receiver recognizes a copy of it; it is refused as a "
            "possible replay. A push the receiver never took (it was down): start that run by hand, "
            "or push again"
        )
    if -age_s > TOLERANCE_S:
        raise SignatureError(
            f"repository.pushed_at is {int(-age_s)} s ahead of the receiver's clock (at most "
            f"{TOLERANCE_S} s); check the receiver's clock"
        )


def verify_api_key(secrets: Iterable[str], headers: Mapping[str, str]) -> None:
    """Check ``X-Tunepod-Key`` against the hook's keys; raises ``SignatureError``. Digests of equal
    length are compared, so the time taken tells nothing of a key's length or its leading characters."""
    received = hashlib.sha256(_required(_lowercase(headers), API_KEY_HEADER).encode()).digest()
    expected = [hashlib.sha256(secret.encode()).digest() for secret in secrets]
    matched = False
    for candidate in expected:
        matched |= hmac.compare_digest(candidate, received)
    if not matched:
        raise SignatureError(f"{API_KEY_HEADER} matches none of the hook's keys")


def eventbridge_dedupe_key(payload: Any) -> str:
    """What an EventBridge event is deduplicated by: its ``id`` (EventBridge keeps it across retries);
    raises ``SignatureError`` for a body that is not an event."""
    event_id = payload.get("id") if isinstance(payload, dict) else None
    if not isinstance(event_id, str) or not event_id:
        raise SignatureError("an EventBridge event names itself in 'id'; this body has none")
    return f"eventbridge:{event_id}"


def check_event_time(payload: Any, max_age_s: float, *, now: float | None = None) -> None:
    """Refuse an EventBridge event whose ``time`` (ISO 8601, UTC) is more than ``max_age_s`` before
    ``now`` (default: the current time) or more than ``TOLERANCE_S`` after it: ``SignatureError``."""
    text = payload.get("time") if isinstance(payload, dict) else None
    try:
        stamp = datetime.fromisoformat(str(text)).timestamp() if isinstance(text, str) else None
    except ValueError:
        stamp = None
    if stamp is None:
        raise SignatureError(
            f"an EventBridge event says when it happened in 'time' (ISO 8601); got {text!r:.60}"
        )
    age_s = (time.time() if now is None else now) - stamp
    if age_s > max_age_s:
        raise SignatureError(
            f"this event happened {int(age_s)} s ago ('time'), more than the {int(max_age_s)} s for which "
            "the receiver recognizes a copy of it; it is refused as a possible replay"
        )
    if -age_s > TOLERANCE_S:
        raise SignatureError(
            f"the event's 'time' is {int(-age_s)} s ahead of the receiver's clock (at most {TOLERANCE_S} s); "
            "check the receiver's clock"
        )


def _any_matches(expected: bytes, received: list[bytes]) -> bool:
    # Every candidate is compared, match or not: the loop's length depends only on what the sender sent.
    matched = False
    for candidate in received:
        matched |= hmac.compare_digest(expected, candidate)
    return matched


def _lowercase(headers: Mapping[str, str]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def _required(lowered: Mapping[str, str], name: str) -> str:
    value = lowered.get(name.lower(), "").strip()
    if not value:
        raise SignatureError(f"missing header {name}")
    return value


def _timestamp(text: str, now: float) -> int:
    if not text.isascii() or not text.isdigit() or len(text) > 12:
        raise SignatureError(f"{WEBHOOK_TIMESTAMP} must be whole seconds since the epoch, got {text[:40]!r}")
    timestamp = int(text)
    if abs(now - timestamp) > TOLERANCE_S:
        raise SignatureError(
            f"{WEBHOOK_TIMESTAMP} is {int(now - timestamp)} s away from the receiver's clock "
            f"(at most {TOLERANCE_S} s either side); check the sender's clock, or this is a replay"
        )
    return timestamp
