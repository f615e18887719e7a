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
``resources.cdc.applier`` parses whole batches of them column-wise.

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
from typing import BinaryIO

from resources.cdc.row_batches import Change, RowBatch
from resources.errors import DRAIN_RESUMES, ProtocolError, storage_fault
from resources.lsn import LSN
from resources.pgoutput.decoder import PgOutputDecoder
from resources.pgoutput.messages import (
    Begin,
    Commit,
    PgOutputMessage,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
)
from resources.pgoutput.relations import RelationCache
from resources.pgoutput.tags import DELETE, INSERT, UPDATE

__all__ = [
    "ChangeLog",
    "CommittedTransaction",
    "TransactionAssembler",
]


DEFAULT_SPILL_BYTES = 16 * 1024 * 1024
"""In-memory bytes per transaction before its changes go to disk."""


def spill_fault(error: OSError, directory: Path) -> Exception:
    """A spill file that cannot be written, in one line naming the directory and ``TMPDIR`` when the
    volume is full or not writable (else ``error`` itself): the drain fails there, nothing confirmed past it."""
    return storage_fault(error, f"the drain's spill files in {directory}", "TMPDIR", DRAIN_RESUMES) or error


class ChangeLog:
    """The changes of one transaction: in memory up to ``spill_bytes``, then in a pickle file.

    Row changes are kept as their raw payload bytes, in lists (runs); Truncate and Relation
    entries as ``(subxid, change)``. A streamed transaction's row payloads carry their
    (sub)transaction xid themselves, so a subtransaction abort is honoured when reading back,
    without rewriting the file.
    """

    __slots__ = (
        "_directory",
        "_name",
        "_spill_bytes",
        "_buffer",
        "_buffer_bytes",
        "_file",
        "_path",
        "_dropped",
        "streamed",
        "relations",
        "count",
        "nbytes",
    )

    def __init__(self, directory: Path, name: str, spill_bytes: int, streamed: bool = False) -> None:
        self._directory = directory
        self._name = name
        self._spill_bytes = spill_bytes
        self._buffer: list[list[bytes] | tuple[int | None, Change]] = []
        self._buffer_bytes = 0
        self._file: BinaryIO | None = None
        self._path: Path | None = None
        self._dropped: set[int] = set()
        self.streamed = streamed
        #: Relations known to the decoder (set at commit): row changes of other oids are refused.
        self.relations: RelationCache | None = None
        self.count = 0
        self.nbytes = 0

    def append(self, subxid: int | None, change: Change, size: int) -> None:
        """A Truncate or Relation entry."""
        self._buffer.append((subxid, change))
        self._added(1, size)

    def append_row(self, payload: bytes) -> None:
        """One row change message (its pgoutput payload, copied)."""
        buffer = self._buffer
        if buffer and type(buffer[-1]) is list:
            buffer[-1].append(payload)
        else:
            buffer.append([payload])
        self._added(1, len(payload))

    def extend_rows(self, payloads: list[bytes], size: int) -> None:
        """Row change messages (``size``: their total bytes); the list is taken over, not copied."""
        buffer = self._buffer
        if buffer and type(buffer[-1]) is list:
            buffer[-1].extend(payloads)
        else:
            buffer.append(payloads)
        self._added(len(payloads), size)

    def _added(self, count: int, size: int) -> None:
        self._buffer_bytes += size
        self.count += count
        self.nbytes += size
        if self._buffer_bytes >= self._spill_bytes:
            self.spill()

    def spill(self) -> None:
        """Write the in-memory part to disk (called at each Stream Stop and past the threshold)."""
        if not self._buffer:
            return
        try:
            if self._file is None:
                self._path = self._directory / f"{self._name}.pickle"
                self._file = open(self._path, "wb")  # noqa: SIM115 - lives as long as the log
            pickle.dump(self._buffer, self._file, protocol=pickle.HIGHEST_PROTOCOL)
        except OSError as error:
            raise spill_fault(error, self._directory.parent) from None
        self._buffer = []
        self._buffer_bytes = 0

    def drop_subtransaction(self, subxid: int) -> None:
        self._dropped.add(subxid)

    @property
    def memory_bytes(self) -> int:
        return self._buffer_bytes

    def _chunks(self) -> Iterator[list[list[bytes] | tuple[int | None, Change]]]:
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as error:
                raise spill_fault(error, self._directory.parent) from None
            with open(self._path, "rb") as stored:  # type: ignore[arg-type]
                while True:
                    try:
                        yield pickle.load(stored)
                    except EOFError:
                        break
        yield self._buffer

    def segments(self) -> Iterator[RowBatch | Change]:
        """The changes in order: runs of row changes as :class:`RowBatch`, the rest as Change tuples.

        Changes of aborted subtransactions are left out.
        """
        dropped = self._dropped
        streamed = self.streamed
        relations = self.relations
        for chunk in self._chunks():
            for entry in chunk:
                if isinstance(entry, list):
                    batch = RowBatch(entry, streamed, dropped)
                    if relations is not None and len(batch):
                        for oid in batch.relation_oids():
                            if oid not in relations:
                                relations.get(oid, LSN(0))  # raises the decoder's ProtocolError
                    if len(batch):
                        yield batch
                else:
                    subxid, change = entry
                    if not dropped or subxid not in dropped:
                        yield change

    def __iter__(self) -> Iterator[Change]:
        for segment in self.segments():
            if type(segment) is RowBatch:
                yield from segment.changes()
            else:
                yield segment  # type: ignore[misc]

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

    def segments(self) -> Iterator[RowBatch | Change]:
        """Runs of row changes column-wise, other changes as tuples (see :meth:`ChangeLog.segments`)."""
        return self.log.segments()

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
        try:
            self._directory = Path(tempfile.mkdtemp(prefix="pgcdc-txn-", dir=spill_dir))
        except OSError as error:
            raise spill_fault(error, Path(spill_dir or tempfile.gettempdir())) from None
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

    def _new_log(self, label: str, streamed: bool = False) -> ChangeLog:
        self._sequence += 1
        return ChangeLog(self._directory, f"{self._sequence}-{label}", self._spill_bytes, streamed)

    def feed(self, payload: bytes | memoryview, wal_start: LSN | int) -> CommittedTransaction | None:
        """Take the next pgoutput message of the session; returns a transaction when one commits.

        Row changes are only copied, not decoded: they are located column-wise when the
        transaction is read (:meth:`CommittedTransaction.segments`). Everything else goes
        through the pgoutput decoder, which also keeps the stream-block state.
        """
        tag = payload[0]
        if tag == INSERT or tag == UPDATE or tag == DELETE:
            self._row_log().append_row(bytes(payload))
            return None
        return self.feed_message(self.decoder.decode(payload, wal_start), len(payload))

    def feed_rows(self, payloads: list[bytes]) -> None:
        """Take consecutive row change messages at once (``ReplicationStream.drain_batches``); the list is kept."""
        self._row_log().extend_rows(payloads, sum(map(len, payloads)))

    def _row_log(self) -> ChangeLog:
        if self.decoder.in_stream:
            if self._stream_xid is None:
                raise ProtocolError("a streamed change arrived outside a stream block", "restart replication")
            return self._streams[self._stream_xid]
        if self._current is None:
            raise ProtocolError("a change arrived outside any transaction", "restart replication")
        return self._current

    def feed_message(self, message: PgOutputMessage, size: int) -> CommittedTransaction | None:
        """Take one decoded message other than a row change (``size``: its payload bytes)."""
        if type(message) is Truncate:
            self._target(message.xid).append(message.xid, ("T", message.relation_oids, None, -1, -1), size)
        elif type(message) is Relation:
            self._target(message.xid).append(message.xid, ("R", message, None, -1, -1), size)
        elif type(message) is Begin:
            if self._current is not None:
                raise ProtocolError(f"Begin at {message.wal_start} inside another transaction", "restart replication")
            self._current = self._new_log(str(message.xid))
            self._current_begin = message
        elif type(message) is Commit:
            if self._current is None or self._current_begin is None:
                raise ProtocolError(f"Commit at {message.wal_start} without Begin", "restart replication")
            done = CommittedTransaction(
                self._current_begin.xid, message.commit_lsn, message.end_lsn, message.commit_time, False, self._current
            )
            self._current.relations = self.decoder.relations
            self._current = None
            self._current_begin = None
            return done
        elif type(message) is StreamStart:
            log = self._streams.get(message.xid)
            if log is None:
                log = self._streams[message.xid] = self._new_log(f"s{message.xid}", streamed=True)
            self._stream_xid = message.xid
        elif type(message) is StreamStop:
            if self._stream_xid is not None:
                self._streams[self._stream_xid].spill()
            self._stream_xid = None
        elif type(message) is StreamCommit:
            log = self._streams.pop(message.xid, None) or self._new_log(f"s{message.xid}", streamed=True)
            log.relations = self.decoder.relations
            return CommittedTransaction(
                message.xid, message.commit_lsn, message.end_lsn, message.commit_time, True, log
            )
        elif type(message) is StreamAbort:
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
