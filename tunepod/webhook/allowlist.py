"""Which S3 objects a hook's deliveries may name: its ``allow`` list of buckets and key prefixes.

Why it exists: the ``eventbridge`` scheme's API key is a bearer credential, sent whole in every request,
not a signature over the body. Whoever has seen one request can post any body with it, and the body
names the data a run stages (``s3://{payload.detail.bucket.name}/...``). The key says who may post; the
allowlist bounds what a post can make a run read.

A delivery to a hook with an allowlist is refused (403, nothing recorded, no event) unless every S3
object its body names, and every ``s3://`` URL its overrides build from the body, lies in one entry:

- the bucket equals the entry's bucket;
- the key starts with the entry's prefix, which is ``""`` (the whole bucket) or ends in ``/``, so
  ``raw/`` never matches ``raw-evil/``. An object key in a body is compared as S3 stores it, URL-decoded
  once (S3 events send keys URL-encoded, ``+`` for a space); a URL an override built is compared as
  written, since that is what the stage step lists;
- the key has no ``.`` or ``..`` segment (``/`` or ``\\`` separated), as written or decoded any number
  of times: S3 keeps such keys literally, but a tool that normalizes paths or decodes once more would
  read outside the prefix, so they are refused rather than normalized.

A body names objects where S3 events put them: ``detail.bucket.name`` and ``detail.object.key`` (an
EventBridge event), each ``Records[n].s3.bucket.name`` and ``Records[n].s3.object.key`` (an S3 event
notification). A body that names none is refused: such a hook takes S3 object events only.

Pure functions, safe to call from any thread. Messages quote a body's values with ``repr``, shortened.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

S3_SCHEME = "s3://"
NAMED_AT = "detail.bucket.name and detail.object.key, or Records[n].s3.bucket.name and .object.key"
_SEPARATORS = re.compile(r"[/\\]")
_MAX_DECODINGS = 8  # a real key is encoded once; a deeper one is refused, not decoded further
_SHOWN_CHARS = 200


@dataclass(frozen=True)
class AllowedPrefix:
    """One place a delivery may name: a bucket and a folder of its keys (``""``: the whole bucket)."""

    bucket: str
    prefix: str

    def holds(self, bucket: str, key: str) -> bool:
        return bucket == self.bucket and key.startswith(self.prefix)


@dataclass(frozen=True)
class Allowlist:
    """A hook's ``allow`` entries; ``hook`` names it in messages."""

    hook: str
    entries: tuple[AllowedPrefix, ...]

    def body_problem(self, payload: Any) -> str | None:
        """Why the body may not start a run (an object outside the list, or none named), or None."""
        named = list(named_objects(payload))
        if not named:
            return (
                f"the body names no S3 object (in {NAMED_AT}); hook {self.hook} has an allow list, so it "
                "takes only S3 events naming an object in it"
            )
        for where, bucket, key in named:
            problem = self._problem(where, bucket, key, urllib.parse.unquote_plus)
            if problem is not None:
                return problem
        return None

    def overrides_problem(self, filled: Sequence[tuple[int, str]]) -> str | None:
        """Why one of the overrides filled from the body, ``(index, "key=value")``, names an ``s3://``
        URL outside the list, or None. Catches a template that reads the bucket from another field."""
        for index, override in filled:
            url = _s3_url(override)
            if url is None:
                continue
            bucket, _, key = url.removeprefix(S3_SCHEME).partition("/")
            problem = self._problem(f"overrides[{index}]", bucket, key, lambda text: text)
            if problem is not None:
                return problem
        return None

    def _problem(self, where: str, bucket: Any, key: Any, as_stored: Callable[[str], str]) -> str | None:
        if not isinstance(bucket, str) or not isinstance(key, str):
            return f"{where} must name an S3 object: its bucket and key as text"
        shown = _shown(f"{S3_SCHEME}{bucket}/{key}")
        if has_dot_segment(key):
            return (
                f"{where} names {shown}, whose key has a '.' or '..' segment (as sent or URL-decoded); "
                "such keys are refused, never normalized: name the object by its plain key"
            )
        if not any(entry.holds(bucket, as_stored(key)) for entry in self.entries):
            return (
                f"{where} names {shown}, outside hook {self.hook}'s allow list; if that data should "
                f"start runs, add its bucket and prefix to hooks.{self.hook}.allow in the receiver's config"
            )
        return None


def named_objects(payload: Any) -> Iterator[tuple[str, Any, Any]]:
    """``(where, bucket, key)`` of each S3 object the body names, as S3 events name them."""
    if not isinstance(payload, dict):
        return
    detail = payload.get("detail")
    if isinstance(detail, dict):  # an EventBridge event
        yield "payload.detail", _at(detail, "bucket", "name"), _at(detail, "object", "key")
    records = payload.get("Records")
    if isinstance(records, list):  # an S3 event notification
        for index, record in enumerate(records):
            s3 = _at(record, "s3")
            yield f"payload.Records[{index}].s3", _at(s3, "bucket", "name"), _at(s3, "object", "key")


def has_dot_segment(key: str) -> bool:
    """Whether ``key`` has a ``.`` or ``..`` segment, as written or URL-decoded any number of times."""
    text = key
    for _ in range(_MAX_DECODINGS):
        if any(segment in (".", "..") for segment in _SEPARATORS.split(text)):
            return True
        decoded = urllib.parse.unquote_plus(text)
        if decoded == text:
            return False
        text = decoded
    return True


def _s3_url(override: str) -> str | None:
    """The ``s3://`` URL an override filled from the body sets, or None. Such an override's value is
    JSON (``OverrideTemplate.render``); a value that is not JSON text is not a URL."""
    _, _, value = override.partition("=")
    try:
        text = json.loads(value)
    except ValueError:
        return None
    return text if isinstance(text, str) and text.startswith(S3_SCHEME) else None


def _at(value: Any, *path: str) -> Any:
    for name in path:
        value = value.get(name) if isinstance(value, dict) else None
    return value


def _shown(text: str) -> str:
    # repr escapes newlines and other control characters: a body's value can never forge a log line.
    return repr(text[:_SHOWN_CHARS] + ("..." if len(text) > _SHOWN_CHARS else ""))
