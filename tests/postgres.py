"""The real PostgreSQL server `scripts/postgres-up` starts, and a fresh database per use.

The script writes the login URL (role ``tunepod``, which may create databases) to a root-only file; each
test gets databases of its own (``<prefix>_<random>``), dropped after it, so tests never see each
other's tables. Without the server a test skips, and fails when CI=true.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path

from needs import skip_or_fail

URL_FILE = Path("/var/lib/tunepod-postgres/url")


def server_url() -> str:
    """The login URL of the test server (its ``tunepod`` database); skips (fails under CI) without it."""
    import psycopg

    try:
        url = URL_FILE.read_text().strip()
    except OSError as exc:
        skip_or_fail(f"no PostgreSQL for this test ({exc}): run sudo scripts/postgres-up")
        raise AssertionError("unreachable") from None
    try:
        psycopg.connect(url, connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        skip_or_fail(f"PostgreSQL at {URL_FILE} does not answer ({exc}): run sudo scripts/postgres-up")
    return url


@contextlib.contextmanager
def fresh_database(prefix: str) -> Iterator[str]:
    """A new empty database owned by the test role; yields its URL (``postgresql://...``), then drops
    it (ending whatever sessions a killed process left open on it)."""
    import psycopg

    url = server_url()
    name = f"{prefix}_{secrets.token_hex(4)}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
