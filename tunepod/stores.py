"""Database URLs as users write them, turned into what each engine's SQLAlchemy driver needs.

Users write ``postgresql://user:password@host:5432/db`` (the libpq form RDS shows) everywhere. SQLAlchemy
reads a bare ``postgresql://`` as psycopg2, which tunepod does not install: MLflow and Optuna get
``postgresql+psycopg://`` (psycopg 3), Prefect's async server ``postgresql+asyncpg://``.

Such a URL holds a password: ``redacted`` is the one way tunepod shows a URL, or a message that may
quote one (messages, logs, the console, MLflow tags, Prefect artifacts), and ``opening_store`` turns a
driver's failure to open a store into an error that quotes neither the URL nor its password.

A job's environment holds credentials by name (``AWS_SECRET_ACCESS_KEY``, ``HF_TOKEN``, ``DB_PASSWORD``):
``is_secret_name`` is the one rule for which names, ``shown_env`` the one way an environment is shown,
and ``secret_values`` finds such values in any document (a spec, a ``--set`` value) so that
``redacted`` can hide them wherever a message quotes them.
"""

from __future__ import annotations

import contextlib
import json
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from tunepod.errors import StoreError, TunepodError
from tunepod.locks import locked

POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")
"""Schemes read as PostgreSQL for MLflow and Optuna (the last one is already what they get)."""


class StoreUrlError(ValueError):
    """A database URL no engine of the stack can use; the message says which forms work."""


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")


def scheme_of(url: str) -> str:
    """The scheme of ``url``, lowercased; "" for a plain path. Never raises: it is asked of URLs that
    do not parse too (an unclosed "[" of an IPv6 host), while reporting them."""
    match = _SCHEME.match(url)
    return match[1].lower() if match else ""


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


HIDDEN = "***"

# scheme://user:PASSWORD@host. Readers differ on where a password with an unencoded "@" or "/" ends
# (SQLAlchemy: at the first "@"; urllib and libpq: at the authority's last "@"), so it is hidden up to
# the last "@" of the URL: a path with an "@" (rare in a store URI) shows less, but no password shows.
_URL_PASSWORD = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@]*:)(?P<secret>[^\s@]*@(?:[^\s@'\"]*@)*)"
)
# A secret query parameter (?password=..., &sslpassword=..., ?token=..., X-Amz-Signature=...).
_QUERY_SECRET = re.compile(
    r"(?P<head>[?&;][\w.-]*(?:pass|pwd|secret|token|api[_-]?key|signature|credential)[\w.-]*=)"
    r"(?P<secret>[^&#\s]*)",
    re.IGNORECASE,
)
# libpq's key=value form (host=db password=s3cret dbname=x), as psycopg may quote a connection string.
_KEYWORD_SECRET = re.compile(
    r"(?P<head>(?<![\w.-])(?:ssl)?password\s*=\s*)(?P<secret>'(?:[^'\\]|\\.)*'|[^\s&'\"]+)",
    re.IGNORECASE,
)
_PATTERNS = (_URL_PASSWORD, _QUERY_SECRET, _KEYWORD_SECRET)
#: A known secret shorter than this is hidden in URL and key=value form only: hidden wherever it occurs,
#: it would cut ordinary words out of a message.
MIN_LOOSE_SECRET = 4


def redacted(text: str, *stores: str, values: Iterable[str] = ()) -> str:
    """``text`` as tunepod shows it, anywhere: a store URI, or a message that may quote one.

    Every URL in it keeps its scheme, user, host, port and path; its password and the values of its
    secret query parameters (``password=``, ``token=``, ...) become ``***``, as does a libpq
    ``password=...``. The secrets of ``stores`` (the URIs a driver's message may quote in another form:
    percent-decoded, or outside any URL) and the secret ``values`` themselves (``secret_values``: as
    written, and as JSON or YAML escapes them) are hidden wherever they occur, each of at least
    ``MIN_LOOSE_SECRET`` characters. Text with nothing to hide comes back unchanged.
    """
    for pattern in _PATTERNS:
        text = pattern.sub(lambda match: match["head"] + _hidden(match["secret"]), text)
    loose = {secret for store in stores for secret in _secrets(store)}
    loose |= {form for value in values for form in (value, json.dumps(value)[1:-1])}
    for secret in sorted(loose, key=len, reverse=True):  # a secret inside another goes after it
        if len(secret) >= MIN_LOOSE_SECRET:
            text = text.replace(secret, HIDDEN)
    return text


# Words that make a variable (or mapping key) a credential, matched against the end of each "_"/"-"
# separated part of its name: HF_TOKEN, WANDB_API_KEY, APIKEY, DB_PASSWORD, AWS_SESSION_TOKEN,
# GITHUB_AUTH. A part that only starts with one (TOKENIZERS_PARALLELISM, KEYRING_BACKEND) is not one.
_SECRET_WORDS = (
    "KEY|KEYS|TOKEN|TOKENS|SECRET|SECRETS|PASSWORD|PASSWORDS|PASSWD|PASSPHRASE|PASS|CREDENTIAL|CREDENTIALS"
    "|CREDS|AUTH|AUTHORIZATION|COOKIE|SIGNATURE|PRIVATE|PAT|DSN"
)
_SECRET_PART = re.compile(rf"[A-Z0-9]*(?:{_SECRET_WORDS})")


def is_secret_name(name: str) -> bool:
    """Whether a variable or mapping key named ``name`` holds a credential (case-insensitive)."""
    return any(_SECRET_PART.fullmatch(part) for part in re.split(r"[_\-.\s]+", name.upper()) if part)


def shown_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as tunepod shows it: the value of each secret name (``is_secret_name``) ``***``, every
    other value ``redacted`` (a URL's password hidden)."""
    return {name: HIDDEN if is_secret_name(name) else redacted(value) for name, value in env.items()}


def secret_values(document: Any) -> list[str]:
    """The values of the secret names (``is_secret_name``) of every ``env`` mapping in ``document`` (a
    spec or a ``--set`` override as YAML reads it, at any depth): what ``redacted`` must hide wherever a
    message quotes the document. Only ``env`` mappings are read: elsewhere a key named like a secret
    is a setting (``secret_env``'s ``key`` names a key of a Kubernetes Secret, not its value)."""
    found: list[str] = []
    if isinstance(document, Mapping):
        for key, value in document.items():
            if key == "env" and isinstance(value, Mapping):
                found += [str(v) for k, v in value.items() if is_secret_name(str(k)) and v is not None]
            found += secret_values(value)
    elif isinstance(document, list):
        for item in document:
            found += secret_values(item)
    return found


def _hidden(secret: str) -> str:
    return f"{HIDDEN}@" if secret.endswith("@") else HIDDEN


def _secrets(url: str) -> set[str]:
    """The secrets of ``url`` as written and percent-decoded (without the "@" that ends a password)."""
    found = {match["secret"].removesuffix("@") for pattern in _PATTERNS for match in pattern.finditer(url)}
    return {form for secret in found for form in (secret, unquote(secret)) if form and form != HIDDEN}


def browsable(url: str) -> str:
    """``url`` without its userinfo, for a link a person opens: a browser asks for the login itself,
    and a link is shown and stored where a password must not be (MLflow tags, Prefect artifacts)."""
    scheme, sep, rest = url.partition("://")
    authority_end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority = rest[:authority_end]
    if not sep or "@" not in authority:
        return redacted(url)
    return redacted(f"{scheme}://{authority.rpartition('@')[2]}{rest[authority_end:]}")


#: Schemes of stores that are a local file: nothing to hide, and their errors pass as they are (SQLite's
#: "database is locked" is retried by its type).
_FILE_SCHEMES = ("", "file", "sqlite", "journal")


@contextlib.contextmanager
def opening_store(what: str, field: str, url: str) -> Iterator[None]:
    """Raise a failure to open the store at ``url`` (``what``, set by the spec's ``field``) as a
    ``StoreError`` naming the store (``redacted``), the driver's reason (``redacted`` too: it keeps
    "connection refused", "password authentication failed", "database does not exist") and the fix.

    The driver's exception is left out of the chain, not attached as the cause: MLflow and SQLAlchemy
    quote the URL in their messages, psycopg may quote the connection string, and a traceback prints
    every exception of a chain. A ``TunepodError`` (tunepod's own words) and the errors of a local file
    store (no password; SQLite's "database is locked" is retried by its type) pass as they are.
    """
    try:
        yield
    except TunepodError:
        raise
    except Exception as exc:
        if scheme_of(url).partition("+")[0] in _FILE_SCHEMES:
            raise
        reason = redacted(f"{type(exc).__name__}: {exc}".strip(), url)
        raise StoreError(
            f"cannot open {what} {redacted(url)} ({reason}); fix: check that the server {field} names "
            f"runs and accepts connections from this machine, and that the user, password and database "
            f"in {field} are right (the reason says which)"
        ) from None


def _with_scheme(url: str, scheme: str) -> str:
    return scheme + url[url.index(":") :]
