"""Errors a user can act on.

Every failure that reaches a user (CLI, Dagster step) is a ``PgcdcError`` whose
message is one line naming the cause and the fix. Lower layers raise the
specific subclasses; ``explain`` turns driver errors into them.
"""

from __future__ import annotations

import errno
import getpass
import os
import pwd
import re
from typing import Literal


class PgcdcError(Exception):
    """A one-line, actionable failure: ``cause: fix``."""

    def __init__(self, cause: str, fix: str) -> None:
        self.cause = cause
        self.fix = fix
        super().__init__(f"{cause}: {fix}")


class TableFault(PgcdcError):
    """A fault of one table's changes or schema (a value Delta cannot hold, a DDL that needs a
    re-snapshot, a write the engine refuses): by default it sets that table aside (quarantine)
    while the drain applies every other table (``on_table_error``, docs/guarantees.md).

    ``column`` names the column at fault, when one is."""

    def __init__(self, cause: str, fix: str, *, column: str | None = None) -> None:
        super().__init__(cause, fix)
        self.column = column


class ConfigurationError(PgcdcError):
    """The server or the pgcdc configuration is not set up for replication."""


class SlotError(PgcdcError):
    """The replication slot is missing, busy, invalidated, or of the wrong kind."""


class ConnectionFailure(PgcdcError):
    """PostgreSQL could not be reached or dropped the connection; retrying may help."""


class ProtocolError(PgcdcError):
    """The replication stream carried something the client does not understand."""


class DeltaLogError(PgcdcError):
    """A Delta table's log cannot be read: a commit file truncated or holding other bytes."""


class StorageFault(PgcdcError):
    """A volume pgcdc writes (the lake, the spill directory) is full or not writable by the user pgcdc
    runs as, or the object store refuses the credentials a write (:func:`storage_fault`). No table's own
    fault: it fails the whole run.

    Recognised in any exception chain by errno (Python's and pyarrow's ``OSError``) or by how the engine
    and the storage clients spell it (Rust's ``(os error 28)``, the AWS SDK's ``ACCESS_DENIED``, delta-rs's
    "lacked the necessary privileges"). PostgreSQL's own "permission denied" (a missing grant) is not a
    volume's: psycopg errors are skipped."""


DRAIN_RESUMES = "run the drain again: nothing was confirmed to the slot past what Delta holds, so it resumes exactly"
"""What to do after fixing a volume a drain could not write (``storage_fault``'s ``then``)."""

Kind = Literal["full", "unwritable", "denied"]

_KINDS: dict[int, Kind] = {
    errno.ENOSPC: "full", errno.EDQUOT: "full",
    errno.EACCES: "unwritable", errno.EPERM: "unwritable", errno.EROFS: "unwritable",
}  # fmt: skip
_PHRASES: dict[str, tuple[Kind, str]] = {
    "no space left on device": ("full", os.strerror(errno.ENOSPC)),
    "disk quota exceeded": ("full", os.strerror(errno.EDQUOT)),
    "read-only file system": ("unwritable", os.strerror(errno.EROFS)),
    "permission denied": ("unwritable", os.strerror(errno.EACCES)),
    "operation not permitted": ("unwritable", os.strerror(errno.EPERM)),
    "access_denied": ("denied", "access denied"),
    "accessdenied": ("denied", "access denied"),
    "lacked the necessary privileges": ("denied", "access denied"),
    "403 forbidden": ("denied", "403 Forbidden"),
}


def storage_fault_kind(error: BaseException) -> tuple[Kind, str] | None:
    """(what kind of storage fault, how the system says it) under ``error`` and its chain, else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if not type(current).__module__.startswith("psycopg"):
            if isinstance(current, OSError) and current.errno in _KINDS:
                return _KINDS[current.errno], os.strerror(current.errno)
            text = str(current).lower()
            for phrase, found in _PHRASES.items():
                if phrase in text:
                    return found
        current = current.__cause__ or current.__context__
    return None


def storage_fault(error: BaseException, where: str, setting: str, then: str) -> StorageFault | None:
    """The one line for ``error`` when a volume is full or not writable, or the store refused, else None.

    ``where`` names what was being written, ``setting`` what points there (``delta.root``, ``TMPDIR``),
    ``then`` what to do after the fix."""
    found = storage_fault_kind(error)
    if found is None:
        return None
    kind, said = found
    if kind == "full":
        return StorageFault(
            f"no space left for {where} ({said})",
            f"free space on that volume or grow it (or point {setting} at a larger one), then {then}",
        )
    if kind == "denied":
        return StorageFault(
            f"the object store refused a write to {where} ({said})",
            "give the credentials (delta.storage.access_key_id / secret_access_key, or AWS_*) write access"
            f" to {setting} (s3:PutObject, s3:DeleteObject), then {then}",
        )
    try:
        name = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        name = "?"
    return StorageFault(
        f"cannot write {where} as user {name} (uid {os.geteuid()}) ({said})",
        f"make {setting} writable by that user (or run pgcdc as its owner), then {then}",
    )


def mask_dsn(dsn: str) -> str:
    """The DSN as ``user@host:port/dbname`` with no password, safe for logs and metadata."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        parts = conninfo_to_dict(dsn)
    except Exception:
        return "<unparseable DSN>"
    user = parts.get("user") or os.environ.get("PGUSER") or getpass.getuser()
    host = parts.get("host") or os.environ.get("PGHOST") or "localhost"
    port = parts.get("port") or os.environ.get("PGPORT") or "5432"
    dbname = parts.get("dbname") or os.environ.get("PGDATABASE") or user
    return f"{user}@{host}:{port}/{dbname}"


def _scrub(text: str, dsn: str | None) -> str:
    """First line of a server message, with any password from the DSN removed."""
    line = text.strip().splitlines()[0] if text.strip() else type(text).__name__
    if dsn:
        from psycopg.conninfo import conninfo_to_dict

        try:
            password = conninfo_to_dict(dsn).get("password")
        except Exception:
            password = None
        if password:
            line = line.replace(str(password), "****")
    return line


def explain(error: BaseException, dsn: str | None = None, *, slot: str | None = None) -> PgcdcError:
    """Turn a psycopg error into an actionable ``PgcdcError``; a ``PgcdcError`` passes through."""
    import psycopg

    if isinstance(error, PgcdcError):
        return error
    message = _scrub(str(error), dsn)
    sqlstate = getattr(error, "sqlstate", None)
    if isinstance(error, psycopg.ProgrammingError) and not sqlstate:
        return ConfigurationError(f"invalid connection string ({message})", "pass a libpq DSN or postgresql:// URL")
    if isinstance(error, psycopg.OperationalError) and not sqlstate and "FATAL" not in message:
        where = mask_dsn(dsn) if dsn else "the server"
        return ConnectionFailure(
            f"cannot reach PostgreSQL at {where} ({message})",
            "check host, port and that the server is running and accepts connections; retry",
        )
    return explain_server_error(sqlstate, message, dsn=dsn, slot=slot)


def explain_server_error(
    sqlstate: str | None, message: str, *, dsn: str | None = None, slot: str | None = None, user: str | None = None
) -> PgcdcError:
    """The one place that maps a server error (SQLSTATE and message) to its cause and fix (``user``: the
    session's role, when no ``dsn`` names it)."""
    where = mask_dsn(dsn) if dsn else "the server"
    message = _scrub(message, dsn) or "unknown server error"
    lowered = message.lower()
    slot_name = f'"{slot}"' if slot else ""
    if sqlstate == "28P01" or "password authentication failed" in lowered:
        return ConfigurationError(
            f"password authentication failed for {where}", "fix the password in the DSN or in PGPASSWORD/.pgpass"
        )
    if "no password supplied" in lowered:
        return ConfigurationError(f"{where} requires a password", "set it in the DSN or in PGPASSWORD/.pgpass")
    if sqlstate == "3D000" or ("database" in lowered and "does not exist" in lowered):
        return ConfigurationError(f"database missing on {where} ({message})", "fix dbname in the DSN")
    if "pg_hba.conf" in lowered:
        return ConfigurationError(
            f"{where} refuses this connection ({message})",
            "add a pg_hba.conf entry for this user (replication connections need their own) and reload PostgreSQL",
        )
    if "wal_level" in lowered:
        return ConfigurationError(
            f"logical decoding is off on {where} ({message})",
            "set wal_level = logical (ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL",
        )
    denied = re.search(r"permission denied for (table|schema) (\S+)", message, re.IGNORECASE)
    if denied is not None:
        kind, name = denied.groups()
        role = user or (mask_dsn(dsn).split("@", 1)[0] if dsn else "<user>")
        grant = f"GRANT SELECT ON {name}" if kind.lower() == "table" else f"GRANT USAGE ON SCHEMA {name}"
        return ConfigurationError(
            f"missing privilege on {where} ({message})",
            f"{grant} TO {role} (snapshots and reconciliation read every replicated table), then run again",
        )
    if sqlstate == "42501" or "replication role" in lowered or "permission denied" in lowered:
        return ConfigurationError(
            f"missing privilege on {where} ({message})",
            "grant it: ALTER ROLE <user> WITH REPLICATION, and SELECT on the published tables",
        )
    if sqlstate == "55006" or ("replication slot" in lowered and "is active" in lowered):
        return SlotError(
            f"replication slot {slot_name} is in use by another consumer ({message})",
            "stop the other consumer (or wait for its run to finish) and retry",
        )
    if "replication slot" in lowered and "does not exist" in lowered:
        return SlotError(
            f"replication slot {slot_name} does not exist on {where}",
            "create it (pgcdc changes --create-slot, or run the snapshot job) or fix the slot name",
        )
    if sqlstate == "42710" and "replication slot" in lowered:
        return SlotError(message, "drop the existing slot or choose another name")
    if sqlstate == "55000" and slot is not None:
        return SlotError(message, "recreate the slot (it was invalidated or has the wrong kind) and re-snapshot")
    if "publication" in lowered and "does not exist" in lowered:
        return ConfigurationError(
            f"{message} on {where}", "CREATE PUBLICATION <name> FOR TABLE ... or fix the publication name"
        )
    if sqlstate == "53400":
        return ConfigurationError(message, "raise max_replication_slots / max_wal_senders or drop unused slots")
    if sqlstate == "22021":  # character_not_in_repertoire: only a SQL_ASCII database's bytes get this far
        return ConfigurationError(
            f"{message} on {where}: text in the database is not UTF-8 (PostgreSQL stores a SQL_ASCII database's bytes unchecked)",
            "fix that value in PostgreSQL, or re-create the database with the ENCODING its text is really in",
        )
    if sqlstate in ("22023", "0A000", "42601"):
        return ConfigurationError(message, "fix the replication options for this server version")
    if sqlstate is None or sqlstate.startswith(("08", "57P")):
        return ConnectionFailure(
            f"connection to {where} failed ({message})", "check that PostgreSQL is running and reachable, then retry"
        )
    return PgcdcError(f"PostgreSQL error on {where} ({message})", "see the PostgreSQL server log for details")


class SnapshotError(PgcdcError):
    """A table could not be copied: a value the mapping refuses, or the Delta write failed."""


class CatalogRefusal(PgcdcError):
    """A Delta table pgcdc wrote could not be registered under its name in the catalog (``catalog:``): a name
    the catalog refuses, or the name held by another table. The table's data is written all the same."""
