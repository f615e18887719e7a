"""SQL quoting for the statements pgcdc builds: identifiers and replication-grammar string constants."""

from __future__ import annotations

from resources.errors import ConfigurationError


def quote_ident(name: str) -> str:
    """A double-quoted SQL identifier, embedded double quotes doubled."""
    if "\x00" in name:
        raise ConfigurationError(f"identifier {name!r} contains a NUL byte", "remove it from the name")
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    """A single-quoted string constant as the replication grammar reads it ('' doubles a quote).

    The replication command scanner has no backslash escapes, and plain SQL has
    standard_conforming_strings on, so doubling single quotes is all it takes.
    """
    if "\x00" in value:
        raise ConfigurationError(f"string {value!r} contains a NUL byte", "remove it from the value")
    return "'" + value.replace("'", "''") + "'"
