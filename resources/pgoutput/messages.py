"""pgoutput messages as Python values: one frozen dataclass per message type, and the unchanged-TOAST sentinel."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, UTC
from typing import Final, TypeAlias

from resources.lsn import LSN

PG_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)


MIN_PROTO_VERSION: Final = 1


MAX_PROTO_VERSION: Final = 4


def pg_timestamp(microseconds: int) -> datetime:
    """A PostgreSQL TimestampTz (microseconds since 2000-01-01 UTC) as an aware datetime."""
    return PG_EPOCH + timedelta(microseconds=microseconds)


class _UnchangedToast:
    """Type of ``UNCHANGED_TOAST``: a TOASTed value the server did not resend."""

    __slots__ = ()
    _instance: _UnchangedToast | None = None

    def __new__(cls) -> _UnchangedToast:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"

    def __reduce__(self) -> str:
        return "UNCHANGED_TOAST"

    def __bool__(self) -> bool:
        return False


UNCHANGED_TOAST: Final = _UnchangedToast()
"""Column kind 'u': unchanged TOASTed value; the actual value is not sent."""


ColumnValue: TypeAlias = "bytes | None | _UnchangedToast"


@dataclass(slots=True, frozen=True)
class TupleData:
    """A row image. ``values[i]`` is bytes (text or binary form), None (NULL) or UNCHANGED_TOAST."""

    values: tuple[ColumnValue, ...]
    #: True if at least one value was sent in binary form (kind 'b').
    binary: bool = False


@dataclass(slots=True, frozen=True)
class RelationColumn:
    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        """Part of the replica identity (flag bit 1; every column under REPLICA IDENTITY FULL)."""
        return bool(self.flags & 1)


@dataclass(slots=True, frozen=True)
class Begin:
    wal_start: LSN
    final_lsn: LSN
    commit_time: datetime
    xid: int


@dataclass(slots=True, frozen=True)
class Message:
    wal_start: LSN
    xid: int | None
    transactional: bool
    lsn: LSN
    prefix: str
    content: bytes


@dataclass(slots=True, frozen=True)
class Commit:
    wal_start: LSN
    flags: int
    commit_lsn: LSN
    end_lsn: LSN
    commit_time: datetime


@dataclass(slots=True, frozen=True)
class Origin:
    wal_start: LSN
    commit_lsn: LSN
    name: str


@dataclass(slots=True, frozen=True)
class Relation:
    wal_start: LSN
    xid: int | None
    oid: int
    #: Schema name; the protocol's empty string is reported as "pg_catalog".
    namespace: str
    name: str
    #: relreplident: 'd' default, 'n' nothing, 'f' full, 'i' index.
    replica_identity: str
    columns: tuple[RelationColumn, ...]

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(column.name for column in self.columns)


@dataclass(slots=True, frozen=True)
class Type:
    wal_start: LSN
    xid: int | None
    oid: int
    #: Schema of the (base) type; the protocol's empty string is reported as "pg_catalog".
    namespace: str
    #: Name of the base type (for a domain, the type it is over).
    name: str


@dataclass(slots=True, frozen=True)
class Insert:
    wal_start: LSN
    xid: int | None
    relation_oid: int
    new: TupleData


@dataclass(slots=True, frozen=True)
class Update:
    wal_start: LSN
    xid: int | None
    relation_oid: int
    #: Old replica identity key ('K'), sent when the key changed.
    key: TupleData | None
    #: Old row ('O'), sent under REPLICA IDENTITY FULL.
    old: TupleData | None
    new: TupleData


@dataclass(slots=True, frozen=True)
class Delete:
    wal_start: LSN
    xid: int | None
    relation_oid: int
    key: TupleData | None
    old: TupleData | None


@dataclass(slots=True, frozen=True)
class Truncate:
    wal_start: LSN
    xid: int | None
    relation_oids: tuple[int, ...]
    cascade: bool
    restart_identity: bool


@dataclass(slots=True, frozen=True)
class StreamStart:
    wal_start: LSN
    xid: int
    first_segment: bool


@dataclass(slots=True, frozen=True)
class StreamStop:
    wal_start: LSN


@dataclass(slots=True, frozen=True)
class StreamCommit:
    wal_start: LSN
    xid: int
    flags: int
    commit_lsn: LSN
    end_lsn: LSN
    commit_time: datetime


@dataclass(slots=True, frozen=True)
class StreamAbort:
    wal_start: LSN
    xid: int
    #: Equal to ``xid`` when the whole transaction aborted, else the aborted subtransaction.
    subxid: int
    #: Protocol 4 with streaming = parallel only; None otherwise.
    abort_lsn: LSN | None = None
    abort_time: datetime | None = None


@dataclass(slots=True, frozen=True)
class BeginPrepare:
    wal_start: LSN
    prepare_lsn: LSN
    end_lsn: LSN
    prepare_time: datetime
    xid: int
    gid: str


@dataclass(slots=True, frozen=True)
class Prepare:
    wal_start: LSN
    flags: int
    prepare_lsn: LSN
    end_lsn: LSN
    prepare_time: datetime
    xid: int
    gid: str


@dataclass(slots=True, frozen=True)
class CommitPrepared:
    wal_start: LSN
    flags: int
    commit_lsn: LSN
    end_lsn: LSN
    commit_time: datetime
    xid: int
    gid: str


@dataclass(slots=True, frozen=True)
class RollbackPrepared:
    wal_start: LSN
    flags: int
    prepare_end_lsn: LSN
    rollback_end_lsn: LSN
    prepare_time: datetime
    rollback_time: datetime
    xid: int
    gid: str


@dataclass(slots=True, frozen=True)
class StreamPrepare:
    wal_start: LSN
    flags: int
    prepare_lsn: LSN
    end_lsn: LSN
    prepare_time: datetime
    xid: int
    gid: str


PgOutputMessage: TypeAlias = (
    Begin
    | Message
    | Commit
    | Origin
    | Relation
    | Type
    | Insert
    | Update
    | Delete
    | Truncate
    | StreamStart
    | StreamStop
    | StreamCommit
    | StreamAbort
    | BeginPrepare
    | Prepare
    | CommitPrepared
    | RollbackPrepared
    | StreamPrepare
)
