"""Database URLs as users write them, turned into what each engine's SQLAlchemy driver needs.

Users write ``postgresql://user:password@host:5432/db`` (the libpq form RDS shows) everywhere. SQLAlchemy
reads a bare ``postgresql://`` as psycopg2, which tunepod does not install: MLflow and Optuna get
``postgresql+psycopg://`` (psycopg 3), Prefect's async server ``postgresql+asyncpg://``.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from tunepod.locks import locked

POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")
"""Schemes read as PostgreSQL for MLflow and Optuna (the last one is already what they get)."""


class StoreUrlError(ValueError):
    """A database URL no engine of the stack can use; the message says which forms work."""


def scheme_of(url: str) -> str:
    return urlsplit(url).scheme.lower()


def is_postgres(url: str) -> bool:
    return scheme_of(url) in POSTGRES_SCHEMES


def sync_sqlalchemy_url(url: str) -> str:
    """The URL MLflow and Optuna open: PostgreSQL through psycopg 3; any other URL unchanged."""
    return _with_scheme(url, "postgresql+psycopg") if is_postgres(url) else url


def prefect_database_url(url: str) -> str:
    """``PREFECT_API_DATABASE_CONNECTION_URL`` for ``url`` (PostgreSQL through asyncpg, or SQLite).

    Raises ``StoreUrlError`` for anything else: Prefect's server runs on those two only."""
    scheme = scheme_of(url)
    if scheme in ("postgresql", "postgres", "postgresql+asyncpg"):
        return _with_scheme(url, "postgresql+asyncpg")
    if scheme in ("sqlite", "sqlite+aiosqlite"):
        return _with_scheme(url, "sqlite+aiosqlite")
    raise StoreUrlError(
        f"{redacted(url)!r}: Prefect's server runs on PostgreSQL or SQLite only; "
        "fix: give postgresql://user:password@host:5432/db (or sqlite:////absolute/path.db)"
    )


@contextlib.contextmanager
def schema_lock(url: str, owner: str) -> Iterator[None]:
    """Hold, for the ``with`` block, a lock that every process opening the store at ``url`` takes:
    the first open of a new store creates its tables, and two processes creating them at once fail
    ("duplicate key value violates unique constraint" on PostgreSQL, a half-migrated SQLite file).

    SQLite: a file lock beside the database (``<db>.lock``). PostgreSQL: a session advisory lock in
    that database, keyed by ``owner`` (``mlflow``, ``optuna``), released by the server if this
    process dies. Anything else (a tracking server serializes its own schema work): no lock.
    """
    if url.startswith("sqlite:///"):
        db = Path(url[len("sqlite:///") :])
        with locked(db.with_name(db.name + ".lock")):
            yield
    elif is_postgres(url):
        import psycopg

        key = zlib.crc32(f"tunepod.schema.{owner}".encode())
        with psycopg.connect(_with_scheme(url, "postgresql"), autocommit=True) as connection:
            connection.execute("SELECT pg_advisory_lock(%s)", (key,))
            try:
                yield
            finally:
                connection.execute("SELECT pg_advisory_unlock(%s)", (key,))
    else:
        yield


def redacted(url: str) -> str:
    """``url`` with its password replaced by ``***``, for output and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _with_scheme(url: str, scheme: str) -> str:
    return scheme + url[url.index(":") :]
