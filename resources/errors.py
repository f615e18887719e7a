"""Errors a user can act on.

Every failure that reaches a user (CLI, Dagster step) is a ``PgcdcError`` whose
message is one line naming the cause and the fix. Lower layers raise the
specific subclasses; ``explain`` turns driver errors into them.
"""

from __future__ import annotations


class PgcdcError(Exception):
    """A one-line, actionable failure: ``cause: fix``."""

    def __init__(self, cause: str, fix: str) -> None:
        self.cause = cause
        self.fix = fix
        super().__init__(f"{cause}: {fix}")


class ConfigurationError(PgcdcError):
    """The server or the pgcdc configuration is not set up for replication."""


class SlotError(PgcdcError):
    """The replication slot is missing, busy, invalidated, or of the wrong kind."""


class ConnectionFailure(PgcdcError):
    """PostgreSQL could not be reached or dropped the connection; retrying may help."""


class ProtocolError(PgcdcError):
    """The replication stream carried something the client does not understand."""
