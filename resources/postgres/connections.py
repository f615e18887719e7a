"""Every PostgreSQL session pgcdc opens, opened in this one place with an empty ``search_path``.

pgcdc's catalog queries run with its role's privileges. A user who can create a function
or operator in a schema on the search path (``public``, or any schema an
``ALTER DATABASE/ROLE ... SET search_path`` names) could otherwise make an unqualified call
resolve to their object, for example an ``int`` overload beating
``pg_catalog.pg_get_replica_identity_index(regclass)``, and run code as pgcdc. PostgreSQL's
own apply and table-sync workers use an empty search path on the publisher for the same
reason. With it only ``pg_catalog`` is searched for functions, operators and types.

The setting travels as a startup option (libpq ``options``), so it is in force before the
first query, also in ``replication=database`` walsender sessions; it beats
``ALTER DATABASE/ROLE ... SET search_path`` and, coming last, a ``search_path`` in the
``options`` the DSN (or ``PGOPTIONS``) already carries, which are otherwise kept.

A side effect, the same on the subscriber: ``regclass``/``regtype``/``format_type()`` output
names objects outside ``pg_catalog`` schema-qualified.

Every session also speaks UTF-8 (``client_encoding=UTF8``), the encoding Arrow and Delta hold:
PostgreSQL converts from the database's encoding (LATIN1, WIN1252, EUC_JP, ...) both in
``COPY TO STDOUT`` and in pgoutput's tuple data, as well as identifiers and messages
(PostgreSQL's own subscriber likewise asks for its database's encoding). A ``SQL_ASCII``
database's bytes are not converted but checked: text that is valid UTF-8 replicates, any other
byte fails the snapshot or drain with PostgreSQL's "invalid byte sequence" error, before
anything is written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict

from resources.errors import ConfigurationError, ConnectionFailure, explain, explain_server_error, PgcdcError

#: What every pgcdc session runs with: nothing but pg_catalog is searched, and text comes as UTF-8.
SEARCH_PATH_SETTINGS: dict[str, str] = {"search_path": ""}
CLIENT_ENCODING = "UTF8"

#: connect_timeout when the DSN sets none (libpq's default waits for the OS, minutes).
CONNECT_TIMEOUT_SECONDS = 10

_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


def libpq_options(settings: Mapping[str, str]) -> str:
    """Render session settings as the libpq ``options`` value: ``-c name=value ...``.

    libpq splits ``options`` on whitespace; a backslash escapes the next
    character, so backslashes and whitespace inside values are escaped.
    """
    parts = []
    for name, value in settings.items():
        if not _SETTING_NAME.match(name):
            raise ConfigurationError(
                f"invalid setting name {name!r}", "use a PostgreSQL parameter name such as TimeZone"
            )
        text = str(value)
        escaped = "".join("\\" + ch if ch == "\\" or ch.isspace() else ch for ch in text)
        parts.append(f"-c {name}={escaped}")
    return " ".join(parts)


def connection_params(
    dsn: str,
    *,
    application_name: str,
    session_settings: Mapping[str, str] | None = None,
    replication: bool = False,
) -> dict[str, Any]:
    """libpq parameters for ``dsn``: its own, plus pgcdc's session settings and the empty search path.

    Setting ``options`` replaces what libpq would take from ``PGOPTIONS``, so that is merged
    in when the DSN has no ``options`` of its own.
    """
    params = conninfo_to_dict(dsn)
    given = str(params.get("options") or os.environ.get("PGOPTIONS", ""))
    ours = libpq_options({**(session_settings or {}), **SEARCH_PATH_SETTINGS})
    params["options"] = f"{given} {ours}" if given.strip() else ours
    params["application_name"] = application_name
    params["client_encoding"] = CLIENT_ENCODING
    params["connect_timeout"] = params.get("connect_timeout") or str(CONNECT_TIMEOUT_SECONDS)
    if replication:
        params["replication"] = "database"
    return params


def connect(
    dsn: str,
    *,
    application_name: str,
    session_settings: Mapping[str, str] | None = None,
    replication: bool = False,
    autocommit: bool = True,
) -> psycopg.Connection:
    """A connection for pgcdc (see the module docstring); a failure becomes pgcdc's one-line error.

    ``replication`` opens a ``replication=database`` walsender session.
    """
    try:
        params = connection_params(
            dsn, application_name=application_name, session_settings=session_settings, replication=replication
        )
        return psycopg.connect(autocommit=autocommit, **params)
    except psycopg.Error as exc:
        raise explain(exc, dsn) from None


def one_line(text: str) -> str:
    return " ".join(text.split())


def from_psycopg(exc: psycopg.Error, *, slot: str | None = None, conn: psycopg.Connection | None = None) -> PgcdcError:
    if (conn is not None and conn.closed) or (isinstance(exc, psycopg.OperationalError) and exc.sqlstate is None):
        return ConnectionFailure(
            one_line(str(exc)) or "connection lost", "check that PostgreSQL is running and reachable, then retry"
        )
    return explain_server_error(exc.sqlstate, exc.diag.message_primary or str(exc), slot=slot)


def from_result(res: pq.abc.PGresult, *, slot: str | None = None) -> PgcdcError:
    sqlstate = res.error_field(pq.DiagnosticField.SQLSTATE)
    primary = res.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
    message = (primary or res.error_message or b"").decode("utf-8", "replace")
    return explain_server_error(sqlstate.decode("ascii") if sqlstate else None, message, slot=slot)
