"""Decoded pgoutput messages -> committed transactions, in commit order.

The server sends a regular transaction whole (Begin .. Commit) when it commits, but a
*streamed* one (protocol 2+, ``streaming = on``) in Stream Start/Stop blocks while it is
still running, interleaved with other transactions, and only later says Stream Commit or
Stream Abort. Nothing may be applied before the commit, and a streamed transaction can be
far larger than memory, so every transaction's changes go to a :class:`ChangeLog`: a list
in memory that spills to a pickle file in a temporary directory past a byte threshold.
A Stream Abort for a subtransaction marks that subxid dropped (its changes are skipped
when the log is read back); a whole abort deletes the file, leaving no trace.

A change is a plain 5-tuple ``(op, subject, payload, new_start, old_start)``, to keep
millions of them cheap: row changes are *not* decoded here. ``payload`` is the pgoutput
message's bytes and the two offsets say where its new and old TupleData start (-1: absent);
``resources.change_batches`` parses whole batches of them column-wise.

* ``("I", relation_oid, payload, new, -1)``
* ``("U", relation_oid, payload, new, old)``: ``old`` is the 'K' image (old key, non-key
  columns NULL; sent when the key changed) or the 'O' image (REPLICA IDENTITY FULL: the
  whole old row); -1 when neither was sent.
* ``("D", relation_oid, payload, -1, old)``
* ``("T", relation_oids, None, -1, -1)``: TRUNCATE of one or more tables.
* ``("R", relation, None, -1, -1)``: a Relation message; kept in sequence because a schema
  change mid-stream applies to the changes after it and not to those before.

In a TupleData a value is text (or binary), NULL, or unchanged TOAST ('u'). A change's
position in its transaction is its index in :meth:`CommittedTransaction.changes`, which is
the same on every replay of the same WAL.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeAlias

from resources.errors import ProtocolError
from resources.lsn import LSN
from resources.pgoutput import (
    Begin,
    PgOutputDecoder,
    Commit,
    PgOutputMessage,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
)

__all__ = ["Change", "ChangeLog", "CommittedTransaction", "TransactionAssembler"]

Change: TypeAlias = tuple[str, Any, bytes | None, int, int]

_INSERT, _UPDATE, _DELETE = b"I"[0], b"U"[0], b"D"[0]
_NEW, _KEY, _OLD = b"N"[0], b"K"[0], b"O"[0]
_TEXT, _BINARY, _NULL, _UNCHANGED = b"t"[0], b"b"[0], b"n"[0], b"u"[0]


def tuple_end(data: bytes, pos: int) -> int:
    """The offset just past the TupleData starting at ``pos``."""
    ncols = (data[pos] << 8) | data[pos + 1]
    pos += 2
    for _ in range(ncols):
        kind = data[pos]
        if kind == _TEXT or kind == _BINARY:
            pos += 5 + int.from_bytes(data[pos + 1 : pos + 5], "big")
        elif kind == _NULL or kind == _UNCHANGED:
            pos += 1
        else:
            raise ProtocolError(f"unknown TupleData column kind {chr(kind)!r}", "restart replication")
    return pos

DEFAULT_SPILL_BYTES = 16 * 1024 * 1024
"""In-memory bytes per transaction before its changes go to disk."""


class ChangeLog:
    """The changes of one transaction: in memory up to ``spill_bytes``, then in a pickle file.

    Each entry carries the (sub)transaction xid that made it, so a subtransaction abort
    can be honoured when reading back without rewriting the file.
    """

    __slots__ = ("_directory", "_name", "_spill_bytes", "_buffer", "_buffer_bytes", "_file", "_path", "_dropped", "count", "nbytes")

    def __init__(self, directory: Path, name: str, spill_bytes: int) -> None:
        self._directory = directory
        self._name = name
        self._spill_bytes = spill_bytes
        self._buffer: list[tuple[int | None, Change]] = []
        self._buffer_bytes = 0
        self._file: BinaryIO | None = None
        self._path: Path | None = None
        self._dropped: set[int] = set()
        self.count = 0
        self.nbytes = 0

    def append(self, subxid: int | None, change: Change, size: int) -> None:
        self._buffer.append((subxid, change))
        self._buffer_bytes += size
        self.count += 1
        self.nbytes += size
        if self._buffer_bytes >= self._spill_bytes:
            self.spill()

    def spill(self) -> None:
        """Write the in-memory part to disk (called at each Stream Stop and past the threshold)."""
        if not self._buffer:
            return
        if self._file is None:
            self._path = self._directory / f"{self._name}.pickle"
            self._file = open(self._path, "wb")  # noqa: SIM115 - lives as long as the log
        pickle.dump(self._buffer, self._file, protocol=pickle.HIGHEST_PROTOCOL)
        self._buffer = []
        self._buffer_bytes = 0

    def drop_subtransaction(self, subxid: int) -> None:
        self._dropped.add(subxid)

    @property
    def memory_bytes(self) -> int:
        return self._buffer_bytes

    def __iter__(self) -> Iterator[Change]:
        dropped = self._dropped
        if self._file is not None:
            self._file.flush()
            with open(self._path, "rb") as stored:  # type: ignore[arg-type]
                while True:
                    try:
                        entries = pickle.load(stored)
                    except EOFError:
                        break
                    for subxid, change in entries:
                        if not dropped or subxid not in dropped:
                            yield change
        for subxid, change in self._buffer:
            if not dropped or subxid not in dropped:
                yield change

    def discard(self) -> None:
        self._buffer = []
        self._buffer_bytes = 0
        if self._file is not None:
            self._file.close()
            self._file = None
            os.unlink(self._path)  # type: ignore[arg-type]


@dataclass
class CommittedTransaction:
    """A committed transaction, released in commit order; :meth:`changes` may be read once or more."""

    xid: int
    #: Start of the commit record (pgoutput's commit_lsn).
    commit_lsn: LSN
    #: End of the commit record: the position a consumer confirms, and the LSN pgcdc records.
    end_lsn: LSN
    commit_time: datetime
    streamed: bool
    log: ChangeLog = field(repr=False)

    @property
    def change_count(self) -> int:
        """Changes received, including those of aborted subtransactions (an upper bound)."""
        return self.log.count

    @property
    def nbytes(self) -> int:
        return self.log.nbytes

    def changes(self) -> Iterator[Change]:
        return iter(self.log)

    def discard(self) -> None:
        self.log.discard()


class TransactionAssembler:
    """Feed every decoded message in order; :meth:`feed` returns a transaction when one commits.

    Memory stays bounded by ``spill_bytes`` per open transaction (plus one stream block per
    streamed transaction until its Stream Stop). Call :meth:`close` to remove the spill
    directory; transactions still open then (streamed, not yet committed) are dropped:
    the server sends them again from the start on the next run, since their commit lies
    beyond anything a consumer confirmed.
    """

    def __init__(
        self,
        proto_version: int,
        spill_dir: str | os.PathLike[str] | None = None,
        *,
        spill_bytes: int = DEFAULT_SPILL_BYTES,
    ) -> None:
        self.decoder = PgOutputDecoder(proto_version)
        self._directory = Path(tempfile.mkdtemp(prefix="pgcdc-txn-", dir=spill_dir))
        self._spill_bytes = spill_bytes
        self._current: ChangeLog | None = None
        self._current_begin: Begin | None = None
        self._streams: dict[int, ChangeLog] = {}
        self._stream_xid: int | None = None
        self._sequence = 0

    @property
    def spill_directory(self) -> Path:
        return self._directory

    @property
    def open_streamed(self) -> int:
        """Streamed transactions received in part and not yet committed or aborted."""
        return len(self._streams)

    @property
    def memory_bytes(self) -> int:
        total = self._current.memory_bytes if self._current is not None else 0
        return total + sum(log.memory_bytes for log in self._streams.values())

    def _new_log(self, label: str) -> ChangeLog:
        self._sequence += 1
        return ChangeLog(self._directory, f"{self._sequence}-{label}", self._spill_bytes)

    def feed(self, payload: bytes | memoryview, wal_start: LSN | int) -> CommittedTransaction | None:
        """Take the next pgoutput message of the session; returns a transaction when one commits.

        Row changes are only located (relation, tuple offsets), not decoded: that is the
        hot path. Everything else goes through the pgoutput decoder, which also keeps the
        stream-block state that tells where a streamed change carries its xid.
        """
        tag = payload[0]
        if tag == _INSERT or tag == _UPDATE or tag == _DELETE:
            data = bytes(payload)
            decoder = self.decoder
            if decoder.in_stream:
                xid: int | None = int.from_bytes(data[1:5], "big")
                base = 5
            else:
                xid, base = None, 1
            oid = int.from_bytes(data[base : base + 4], "big")
            if oid not in decoder.relations:
                decoder.relations.get(oid, LSN(wal_start))  # raises the decoder's ProtocolError
            kind = data[base + 4]
            if tag == _INSERT:
                change: Change = ("I", oid, data, base + 5, -1)
            elif tag == _UPDATE:
                if kind == _KEY or kind == _OLD:
                    old = base + 5
                    change = ("U", oid, data, tuple_end(data, old) + 1, old)
                else:
                    change = ("U", oid, data, base + 5, -1)
            else:
                change = ("D", oid, data, -1, base + 5)
            self._target(xid).append(xid, change, len(data))
            return None
        return self.feed_message(self.decoder.decode(payload, wal_start), len(payload))

    def feed_message(self, message: PgOutputMessage, size: int) -> CommittedTransaction | None:
        """Take one decoded message other than a row change (``size``: its payload bytes)."""
        kind = type(message)
        if kind is Truncate:
            self._target(message.xid).append(message.xid, ("T", message.relation_oids, None, -1, -1), size)
        elif kind is Relation:
            self._target(message.xid).append(message.xid, ("R", message, None, -1, -1), size)
        elif kind is Begin:
            if self._current is not None:
                raise ProtocolError(f"Begin at {message.wal_start} inside another transaction", "restart replication")
            self._current = self._new_log(str(message.xid))
            self._current_begin = message
        elif kind is Commit:
            if self._current is None or self._current_begin is None:
                raise ProtocolError(f"Commit at {message.wal_start} without Begin", "restart replication")
            done = CommittedTransaction(
                self._current_begin.xid, message.commit_lsn, message.end_lsn, message.commit_time, False, self._current
            )
            self._current = None
            self._current_begin = None
            return done
        elif kind is StreamStart:
            log = self._streams.get(message.xid)
            if log is None:
                log = self._streams[message.xid] = self._new_log(f"s{message.xid}")
            self._stream_xid = message.xid
        elif kind is StreamStop:
            if self._stream_xid is not None:
                self._streams[self._stream_xid].spill()
            self._stream_xid = None
        elif kind is StreamCommit:
            log = self._streams.pop(message.xid, None) or self._new_log(f"s{message.xid}")
            return CommittedTransaction(message.xid, message.commit_lsn, message.end_lsn, message.commit_time, True, log)
        elif kind is StreamAbort:
            if message.subxid == message.xid:
                aborted = self._streams.pop(message.xid, None)
                if aborted is not None:
                    aborted.discard()
            elif message.xid in self._streams:
                self._streams[message.xid].drop_subtransaction(message.subxid)
        # Type, Origin and Message carry nothing to apply: types are read from the catalog by oid.
        return None

    def _target(self, xid: int | None) -> ChangeLog:
        if xid is not None and self._stream_xid is not None:
            return self._streams[self._stream_xid]
        if self._current is None:
            raise ProtocolError("a change arrived outside any transaction", "restart replication")
        return self._current

    def close(self) -> None:
        for log in self._streams.values():
            log.discard()
        self._streams.clear()
        if self._current is not None:
            self._current.discard()
            self._current = None
        shutil.rmtree(self._directory, ignore_errors=True)

    def __enter__(self) -> TransactionAssembler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
