"""Whether a hook's overrides pass its spec's validation, with recent verdicts kept.

Validating a delivery's overrides is loading the hook's spec file with them (``load_spec``): the
loader parses a text's YAML once and keeps it, so a new list of overrides costs reading the file,
applying them and pydantic's validation (about 1 ms of CPU for the digits spec; 4-20 ms before the
YAML was kept). The verdict for one version of the spec file and one list of overrides is always
the same, so the most recent ``capacity`` verdicts are kept and reused:

- keyed by the spec file's (mtime, size, inode): an edited spec is read again at the next delivery;
- for at most ``ttl_s`` seconds: validation also checks that the entrypoint scripts exist, and a
  script deleted or restored changes no stamp of the spec file;
- and by the working directory, against which the spec's relative paths resolve.

Deliveries whose payloads fill the same values (a hook that sets ``num_trials``, a GitHub push of one
repository) are validated once a minute; each new value (an S3 key) pays for a load.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence

from tunepod.errors import SpecError
from tunepod.spec.loader import load_spec

DEFAULT_CAPACITY = 1024
DEFAULT_TTL_S = 60.0

_Stamp = tuple[int, int, int]


class SpecChecker:
    """``problem(spec, overrides)``: why the spec with these overrides is invalid, or None. Thread safe."""

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._verdict = functools.lru_cache(maxsize=capacity)(_validate)

    def problem(self, spec: str, overrides: Sequence[str]) -> str | None:
        """The ``SpecError`` message of loading ``spec`` with ``overrides``, or None when it loads."""
        stamp = _stamp(spec)
        if stamp is None:  # missing or unreadable: load_spec says which, and that is not kept
            return _validate(spec, tuple(overrides))
        period = int(self._clock() // self._ttl_s)  # a verdict is reused within one period only
        return self._verdict(spec, tuple(overrides), stamp, os.getcwd(), period)


def _validate(spec: str, overrides: tuple[str, ...], *_key: object) -> str | None:
    """Load ``spec`` with ``overrides``; ``_key`` only tells the kept verdicts apart."""
    try:
        load_spec(spec, overrides)
    except SpecError as exc:
        return str(exc)
    return None


def _stamp(spec: str) -> _Stamp | None:
    try:
        stat = os.stat(spec)
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size, stat.st_ino
