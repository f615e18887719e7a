"""Caches of the Relation and Type messages a session has sent, by oid: the decoder describes rows with them."""

from __future__ import annotations

from typing import Generic, TypeVar

from resources.errors import ProtocolError
from resources.lsn import LSN
from resources.pgoutput.messages import Relation, Type

_Described = TypeVar("_Described", Relation, Type)


class _OidCache(Generic[_Described]):
    """Oid -> the latest message describing it; a newer message for an oid replaces the entry."""

    __slots__ = ("_by_oid",)

    def __init__(self) -> None:
        self._by_oid: dict[int, _Described] = {}

    def update(self, message: _Described) -> None:
        self._by_oid[message.oid] = message

    def __contains__(self, oid: object) -> bool:
        return oid in self._by_oid

    def __len__(self) -> int:
        return len(self._by_oid)

    def clear(self) -> None:
        self._by_oid.clear()


class RelationCache(_OidCache[Relation]):
    """Relation oid -> latest Relation message."""

    __slots__ = ()

    def get(self, oid: int, lsn: LSN | int | None = None) -> Relation:
        """The relation ``oid``; ``ProtocolError`` if no Relation message described it."""
        try:
            return self._by_oid[oid]
        except KeyError:
            where = f" at {LSN(lsn)}" if lsn is not None else ""
            raise ProtocolError(
                f"change{where} names relation oid {oid}, which no Relation message described",
                "decode the session from its start (the server sends Relation before the first change of each table)",
            ) from None


class TypeCache(_OidCache[Type]):
    """Type oid -> latest Type message."""

    __slots__ = ()

    def get(self, oid: int) -> Type | None:
        """The Type message for ``oid``, or None (built-in types are never described)."""
        return self._by_oid.get(oid)
