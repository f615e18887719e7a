"""Decoded pgoutput messages as JSON objects: the output contract of ``pgcdc changes``.

Every object has ``type`` and ``lsn`` (the XLogData start). Row values are
PostgreSQL's text form (JSON null for NULL); in binary mode they are the binary
send format as ``\\x`` hex. Unchanged TOAST columns are left out of ``new`` and
listed in ``unchanged``, so a reader never mistakes "not sent" for NULL.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from resources.lsn import LSN
from resources.pgoutput.decoder import PgOutputDecoder
from resources.pgoutput.messages import (
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
    PgOutputMessage,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    UNCHANGED_TOAST,
    Update,
)

TYPE_NAMES: dict[type, str] = {
    Begin: "begin",
    Commit: "commit",
    Origin: "origin",
    Relation: "relation",
    Type: "type",
    Insert: "insert",
    Update: "update",
    Delete: "delete",
    Truncate: "truncate",
    Message: "message",
    StreamStart: "stream_start",
    StreamStop: "stream_stop",
    StreamCommit: "stream_commit",
    StreamAbort: "stream_abort",
    BeginPrepare: "begin_prepare",
    Prepare: "prepare",
    CommitPrepared: "commit_prepared",
    RollbackPrepared: "rollback_prepared",
    StreamPrepare: "stream_prepare",
}

#: Fields rendered by hand (tuples, relation references) or carried as ``lsn``.
_SPECIAL_FIELDS = {"wal_start", "relation_oid", "relation_oids", "new", "old", "key", "columns", "content"}


def _scalar(value: Any) -> Any:
    if isinstance(value, LSN):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def _value(raw: bytes | None, binary: bool) -> str | None:
    if raw is None:
        return None
    return "\\x" + raw.hex() if binary else raw.decode("utf-8")


def _row(
    tuple_data: TupleData, relation: Relation, only_key_columns: bool = False
) -> tuple[dict[str, str | None], list[str]]:
    row: dict[str, str | None] = {}
    unchanged: list[str] = []
    for column, raw in zip(relation.columns, tuple_data.values, strict=True):
        if raw is UNCHANGED_TOAST:
            unchanged.append(column.name)
        elif not only_key_columns or column.is_key:
            row[column.name] = _value(raw, tuple_data.binary)  # type: ignore[arg-type]
    return row, unchanged


def message_to_json(message: PgOutputMessage, decoder: PgOutputDecoder) -> dict[str, Any]:
    """One JSON-ready object for one decoded message; relation names come from the decoder's cache."""
    out: dict[str, Any] = {"type": TYPE_NAMES[type(message)], "lsn": str(LSN(message.wal_start))}
    for name in message.__dataclass_fields__:
        if name not in _SPECIAL_FIELDS:
            value = getattr(message, name)
            if value is not None or name != "xid":
                out[name] = _scalar(value)

    if isinstance(message, Message):
        out["content"] = message.content.decode("utf-8", errors="replace")
    elif isinstance(message, Relation):
        out["relation"] = f"{message.namespace}.{message.name}"
        out["columns"] = [
            {"name": c.name, "type_oid": c.type_oid, "type_modifier": c.type_modifier, "key": c.is_key}
            for c in message.columns
        ]
    elif isinstance(message, Truncate):
        out["relations"] = [_relation_name(decoder, oid, message.wal_start) for oid in message.relation_oids]
    elif isinstance(message, Insert | Update | Delete):
        relation = decoder.relations.get(message.relation_oid, message.wal_start)
        out["relation"] = f"{relation.namespace}.{relation.name}"
        if isinstance(message, Insert | Update):
            out["new"], unchanged = _row(message.new, relation)
            if unchanged:
                out["unchanged"] = unchanged
        key = getattr(message, "key", None)
        if key is not None:
            out["key"], _ = _row(key, relation, only_key_columns=True)
        old = getattr(message, "old", None)
        if old is not None:
            out["old"], _ = _row(old, relation)
    return out


def _relation_name(decoder: PgOutputDecoder, oid: int, wal_start: LSN) -> str:
    relation = decoder.relations.get(oid, wal_start)
    return f"{relation.namespace}.{relation.name}"
