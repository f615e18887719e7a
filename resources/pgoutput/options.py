"""The pgoutput plugin options of START_REPLICATION, and the protocol version each server supports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from resources.errors import ConfigurationError
from resources.sql import quote_ident, quote_literal

StreamingMode = Literal["off", "on", "parallel"]


def highest_proto_version(server_version_num: int) -> int:
    """The newest pgoutput protocol a server speaks: 14 -> 2, 15 -> 3, 16+ -> 4."""
    if server_version_num >= 160000:
        return 4
    if server_version_num >= 150000:
        return 3
    if server_version_num >= 140000:
        return 2
    return 1


@dataclass(frozen=True)
class PgOutputOptions:
    """pgoutput's START_REPLICATION options; only non-default ones are sent."""

    publication_names: Sequence[str] = field(default_factory=list)
    proto_version: int | None = None  # None: the highest the server supports
    binary: bool = False
    messages: bool = False
    streaming: StreamingMode = "off"
    two_phase: bool = False
    origin: Literal["any", "none"] | None = None

    def resolve_proto_version(self, server_version_num: int) -> int:
        """The protocol version to request, validated against the server."""
        highest = highest_proto_version(server_version_num)
        major = server_version_num // 10000
        proto = highest if self.proto_version is None else self.proto_version
        if not isinstance(proto, int) or not 1 <= proto <= 4:
            raise ConfigurationError(f"invalid pgoutput proto_version {proto!r}", "use 1, 2, 3 or 4")
        if proto > highest:
            raise ConfigurationError(
                f"pgoutput protocol version {proto} is not supported by PostgreSQL {major} (highest: {highest})",
                f"use proto_version={highest} or leave it unset",
            )
        return proto

    def validate(self, server_version_num: int) -> int:
        """Check the combination against the server; returns the protocol version to use."""
        proto = self.resolve_proto_version(server_version_num)
        major = server_version_num // 10000
        names = [self.publication_names] if isinstance(self.publication_names, str) else list(self.publication_names)
        if not names or any(not isinstance(n, str) or not n for n in names):
            raise ConfigurationError("publication_names is empty", "name at least one publication")
        if self.streaming not in ("off", "on", "parallel"):
            raise ConfigurationError(f"invalid streaming mode {self.streaming!r}", "use 'off', 'on' or 'parallel'")
        if self.streaming == "on" and proto < 2:
            raise ConfigurationError("streaming='on' needs pgoutput protocol 2 or newer", "use proto_version >= 2")
        if self.streaming == "parallel" and proto < 4:
            raise ConfigurationError(
                f"streaming='parallel' needs pgoutput protocol 4 (PostgreSQL 16+), not {proto} on PostgreSQL {major}",
                "use streaming='on' or a newer server",
            )
        if self.two_phase and proto < 3:
            raise ConfigurationError(
                f"two_phase needs pgoutput protocol 3 (PostgreSQL 15+), not {proto} on PostgreSQL {major}",
                "turn two_phase off or use a newer server",
            )
        if (self.binary or self.messages) and server_version_num < 140000:
            raise ConfigurationError("binary and messages need PostgreSQL 14+", "turn them off")
        if self.origin is not None:
            if self.origin not in ("any", "none"):
                raise ConfigurationError(f"invalid origin {self.origin!r}", "use 'any' or 'none'")
            if server_version_num < 160000:
                raise ConfigurationError(f"origin needs PostgreSQL 16+, not {major}", "leave origin unset")
        return proto

    def publication_names_value(self) -> str:
        """The publication_names option value: identifiers, double-quoted, comma-separated."""
        names = [self.publication_names] if isinstance(self.publication_names, str) else self.publication_names
        return ",".join(quote_ident(n) for n in names)

    def render(self, server_version_num: int) -> str:
        """The parenthesised option list of START_REPLICATION, e.g. ``(proto_version '3', ...)``."""
        proto = self.validate(server_version_num)
        opts = [f"proto_version {quote_literal(str(proto))}"]
        opts.append(f"publication_names {quote_literal(self.publication_names_value())}")
        if self.binary:
            opts.append("binary 'true'")
        if self.messages:
            opts.append("messages 'true'")
        if self.streaming != "off":
            opts.append(f"streaming {quote_literal(self.streaming)}")
        if self.two_phase:
            opts.append("two_phase 'true'")
        if self.origin is not None:
            opts.append(f"origin {quote_literal(self.origin)}")
        return "(" + ", ".join(opts) + ")"
