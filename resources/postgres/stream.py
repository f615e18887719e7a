"""The COPY BOTH stream of a replication session: frames out, batched by transaction boundaries, status updates and keepalives back."""

from __future__ import annotations

import select
import time
from collections.abc import Iterator
from types import TracebackType

import psycopg
from psycopg import pq

from resources.errors import ConfigurationError, ConnectionFailure, PgcdcError, ProtocolError, SlotError
from resources.lsn import LSN
from resources.pgoutput.boundaries import HOLD, LAST, TransactionBoundaries
from resources.pgoutput.options import PgOutputOptions
from resources.pgoutput.tags import DELETE, INSERT, UPDATE
from resources.postgres import libpq_io
from resources.postgres.copy_both import connection_lost, enter_copy_both, finish_results, leave_copy_both
from resources.postgres.frames import (
    Keepalive,
    KEEPALIVE_TAG,
    new_lsn,
    new_tuple,
    PAYLOAD,
    unpack_xlog,
    XLOGDATA,
    XLogData,
)
from resources.postgres.replication import ReplicationConnection
from resources.postgres.slots import validate_slot_name
from resources.postgres.standby_status import StandbyStatus
from resources.sql import quote_ident


def _resumed(status: StandbyStatus, received: int) -> float:
    """Back in the drain after handing out an item; returns the time, the drain's new last activity.

    The consumer may have spent long on that item (a Delta write), so a status update is sent
    here if one is due, and the time away counts as activity rather than server silence.
    """
    now = time.monotonic()
    if now >= status.next_due:
        if received > status.received:
            status.received = received
        status.send()
    return now


class ReplicationStream:
    """START_REPLICATION ... LOGICAL over COPY BOTH, read without blocking the process.

    The positions reported to the server and when are :class:`StandbyStatus`'s
    (``standby_status.py``); entering and leaving COPY BOTH is ``copy_both.py``'s.

    The walsender drops a client it has not heard from for ``wal_sender_timeout``, also
    while that client is busy elsewhere (say, waiting for a Delta write) and not reading.
    Status updates go out every ``status_interval`` seconds, lowered at :meth:`start` to a
    quarter of the server's ``wal_sender_timeout``: the drain checks the clock whenever its
    consumer hands control back, and a consumer that holds on to control for long calls
    :meth:`keepalive` meanwhile. Everything that touches the connection runs on one thread.
    """

    def __init__(
        self,
        conn: ReplicationConnection,
        *,
        status_interval: float = 10.0,
        idle_probe: float = 0.2,
        idle_timeout: float = 120.0,
    ) -> None:
        self._conn = conn
        self._pgconn = conn.pgconn
        self.idle_probe = idle_probe
        self.idle_timeout = idle_timeout
        self._streaming = False
        self._slot: str | None = None
        self._poller: select.poll | None = None
        self._saved_nonblocking = 0
        self._status = StandbyStatus(self._pgconn, interval=status_interval, timeout=idle_timeout, lost=self._lost)
        # protocol state kept across drains
        self._boundaries = TransactionBoundaries()
        self._pending: XLogData | None = None  # a frame peeked at by drain but not handed out
        self._pending_start = 0
        # progress counters
        self.frames = 0
        self.bytes = 0
        self.discarded = 0  # frames thrown away by stop()

    # -- progress

    @property
    def streaming(self) -> bool:
        return self._streaming

    @property
    def last_received_lsn(self) -> LSN:
        """The highest WAL position received (XLogData or keepalive)."""
        return LSN(self._status.received)

    @property
    def server_wal_end(self) -> LSN:
        """The walsender's position from its latest keepalive."""
        return LSN(self._status.server_wal_end)

    @property
    def confirmed_lsn(self) -> LSN:
        """The highest position passed to :meth:`confirm` (or the slot's when streaming started)."""
        return LSN(self._status.confirmed)

    @property
    def reported_flush_lsn(self) -> LSN:
        """The flush position last sent to the server."""
        return LSN(self._status.reported_flush)

    @property
    def status_interval(self) -> float:
        """Seconds between status updates (at most a quarter of the server's ``wal_sender_timeout``)."""
        return self._status.interval

    @property
    def keepalives(self) -> int:
        """Primary keepalives received."""
        return self._status.keepalives

    @property
    def status_updates(self) -> int:
        """Standby status updates sent."""
        return self._status.updates

    @property
    def in_transaction(self) -> bool:
        """A transaction (or streamed block) was begun and not yet closed."""
        return self._boundaries.open

    # -- lifecycle

    def __enter__(self) -> ReplicationStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._streaming and not self._conn.closed:
            if exc_type is None:
                self.stop()
            else:
                try:
                    self.stop()
                except PgcdcError:
                    pass

    def start(self, slot: str, start_lsn: LSN = LSN(0), options: PgOutputOptions | None = None) -> None:
        """START_REPLICATION SLOT "slot" LOGICAL start_lsn (options); raises on anything but COPY BOTH.

        The server starts at ``start_lsn`` or the slot's confirmed_flush_lsn, whichever is greater.
        """
        if self._streaming:
            raise ProtocolError("the replication stream is already started", "call stop() first")
        if options is None:
            raise ConfigurationError(
                "START_REPLICATION needs pgoutput options", "pass PgOutputOptions(publication_names=[...])"
            )
        validate_slot_name(slot)
        rendered = options.render(self._conn.server_version_num)
        state = self._conn.read_slot(slot)
        if state is None:
            raise SlotError(f'replication slot "{slot}" does not exist', "create the slot first or check the slot name")
        if state.slot_type != "logical":
            raise SlotError(
                f'replication slot "{slot}" is not a logical slot', "use a logical slot created for pgoutput"
            )
        if self._conn.in_transaction:
            raise ProtocolError("START_REPLICATION inside a transaction", "commit() the snapshot transaction first")
        if self._conn._replication_started:
            # The walsender does not reset its end-of-streaming flags for a second logical
            # START_REPLICATION: it would end the new stream at once (seen on 15 and 18).
            raise ProtocolError(
                "this connection already ran START_REPLICATION once",
                "open a new ReplicationConnection for each replication stream",
            )
        timeout_ms = self._conn.execute(
            "SELECT setting FROM pg_catalog.pg_settings WHERE name OPERATOR(pg_catalog.=) 'wal_sender_timeout'"
        )[0][0]
        self._status.begin(int(state.confirmed_flush_lsn or 0), int(start_lsn), int(timeout_ms))
        self._boundaries = TransactionBoundaries()
        self._pending = None

        pgconn = self._pgconn
        command = f"START_REPLICATION SLOT {quote_ident(slot)} LOGICAL {LSN(start_lsn)} {rendered}"
        self._saved_nonblocking = pgconn.nonblocking
        pgconn.nonblocking = 1
        try:
            enter_copy_both(pgconn, command, slot, self.idle_timeout)
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None
        except PgcdcError:
            pgconn.nonblocking = self._saved_nonblocking
            raise
        self._streaming = True
        self._conn._replication_started = True
        self._slot = slot
        self._poller = select.poll()
        self._poller.register(pgconn.socket, select.POLLIN)
        # Report where we stand (and any confirm() made before start) right away.
        self.send_status()

    def confirm(self, lsn: LSN) -> None:
        """Declare everything up to ``lsn`` durable: it is reported as flushed from now on.

        Lower values than an earlier confirmation are ignored (the slot never moves back).
        The position is sent with the next status update, at the latest by :meth:`stop`.
        """
        self._status.confirm(int(lsn))

    def send_status(self, reply_requested: bool = False) -> None:
        """Send a standby status update now: write = received, flush = apply = confirmed."""
        self._status.send(reply_requested)

    def keepalive(self) -> None:
        """Send a status update if one is due (the same confirmed position, nothing newer).

        For a consumer that keeps the stream without reading it for a while, e.g. while it waits
        for Delta: call it at least every ``status_interval`` seconds, from the thread that
        drains (libpq connections are not to be used by two threads at once).
        """
        if self._streaming and time.monotonic() >= self._status.next_due:
            self._status.send()

    def stop(self, timeout: float = 60.0) -> None:
        """End the stream (CopyDone), discard what is still in flight, and leave the connection usable."""
        if not self._streaming:
            return
        pgconn = self._pgconn
        deadline = time.monotonic() + timeout
        try:
            self.send_status()
            discarded, error = leave_copy_both(pgconn, self._poller, deadline, self._slot)
            self.discarded += discarded
        except psycopg.OperationalError as exc:
            self._streaming = False
            raise self._lost(exc) from None
        finally:
            self._streaming = False
            self._poller = None
            self._pending = None
            if not pgconn.status == pq.ConnStatus.BAD:
                pgconn.nonblocking = self._saved_nonblocking
        if error is not None:
            raise error

    # -- reading

    def read(self, timeout: float | None = None) -> XLogData | Keepalive | None:
        """The next frame (XLogData or Keepalive), or None after ``timeout`` seconds of silence.

        A convenience for tools and tests; :meth:`drain` is the fast path.
        """
        self._require_streaming()
        if self._pending is not None:
            frame, self._pending = self._pending, None
            self._boundaries.track(frame.payload, int(frame.wal_start))
            return frame
        deadline = None if timeout is None else time.monotonic() + timeout
        pgconn = self._pgconn
        while True:
            try:
                nbytes, buf = pgconn.get_copy_data(1)
            except psycopg.OperationalError as exc:
                raise self._lost(exc) from None
            if nbytes > 0:
                kind = buf[0]
                if kind == XLOGDATA:
                    start, end, sent = unpack_xlog(buf, 1)
                    self.frames += 1
                    self.bytes += nbytes
                    if end > self._status.received:
                        self._status.received = end
                    lsn = new_lsn(LSN, start)
                    frame = new_tuple(XLogData, (lsn, lsn if end == start else new_lsn(LSN, end), sent, buf[PAYLOAD:]))
                    self._boundaries.track(frame.payload, start)
                    return frame
                if kind == KEEPALIVE_TAG:
                    return self._status.on_keepalive(buf)
                raise ProtocolError(f"unexpected replication message type {chr(kind)!r}", "check the server version")
            if nbytes == -1:
                self._end_of_copy()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            if now >= self._status.next_due:
                self._status.send()
            wait_until = self._status.next_due if deadline is None else min(deadline, self._status.next_due)
            libpq_io.wait_readable(self._pgconn, self._poller, wait_until, raise_on_timeout=False)
            self._consume()

    def drain(self, end_lsn: LSN, *, stop: bool = True) -> Iterator[XLogData]:
        """Yield XLogData frames up to ``end_lsn``, ending on a transaction boundary.

        Ends (a) after a Commit/Prepare/Stream Stop or standalone message whose end is at or
        past ``end_lsn``, (b) before a Begin (not yielded) whose commit starts at or past it,
        or (c) on a keepalive at or past it while no transaction is open. With ``stop`` the
        stream is stopped when the drain ends (also on error or when the caller breaks out),
        sending the confirmed position; otherwise the caller calls :meth:`stop` (soon: the
        walsender times out a client that does not read).
        """
        self._require_streaming()
        try:
            yield from self._drain(int(end_lsn))  # type: ignore[misc]  # no max_batch_bytes: frames only, no lists
        finally:
            if stop and self._streaming and not self._conn.closed:
                self.stop()

    def drain_batches(
        self, end_lsn: LSN, *, stop: bool = True, max_batch_bytes: int = 1 << 20
    ) -> Iterator[XLogData | list[bytes]]:
        """:meth:`drain` for bulk consumers: row changes come in lists of payload bytes.

        Same frames, order and end as :meth:`drain`, except that consecutive Insert/Update/Delete
        messages inside a transaction or streamed block are handed out as one ``list`` of their
        payloads (copied, so they can be kept), without a frame object or LSN per message;
        every other message is yielded as an :class:`XLogData` frame, as by :meth:`drain`. A list
        holds about ``max_batch_bytes`` at most, so a large transaction never piles up here.
        """
        self._require_streaming()
        try:
            yield from self._drain(int(end_lsn), max_batch_bytes)
        finally:
            if stop and self._streaming and not self._conn.closed:
                self.stop()

    def _drain(self, end: int, max_batch_bytes: int = 0) -> Iterator[XLogData | list[bytes]]:
        """The drain loop; with ``max_batch_bytes`` > 0, row changes are batched (:meth:`drain_batches`)."""
        # hot loop: one function so the per-frame state stays in locals (bench.decode measures it);
        # the transaction-boundary rules are TransactionBoundaries.classify, waiting is _idle.
        bounds = self._boundaries
        pending = self._pending
        if pending is not None:
            # A frame an earlier drain stopped in front of; _pending_start is where its record starts.
            if self._pending_start >= end:
                return
            self._pending = None
            record_end = bounds.track(pending.payload, int(pending.wal_start))
            yield pending
            if record_end >= end:
                return
        get = self._pgconn.get_copy_data
        classify = bounds.classify
        is_open = bounds.open
        status = self._status
        frames = nbytes_total = 0
        received = status.received
        last_activity = time.monotonic()
        probed_at = 0.0
        batching = max_batch_bytes > 0
        batch: list[bytes] = []
        add = batch.append
        batch_bytes = 0
        try:
            while True:
                nbytes, buf = get(1)
                if nbytes > 0:
                    if buf[0] == XLOGDATA:
                        frames += 1
                        nbytes_total += nbytes
                        if batching:
                            tag = buf[PAYLOAD]
                            if (tag == INSERT or tag == UPDATE or tag == DELETE) and is_open:
                                # Row changes never end a drain and lie below their commit's LSN, which
                                # `received` takes when the commit arrives: no header unpacking here.
                                add(bytes(buf[PAYLOAD:]))
                                batch_bytes += nbytes
                                if batch_bytes >= max_batch_bytes:
                                    yield batch
                                    last_activity = _resumed(status, received)
                                    batch = []
                                    add = batch.append
                                    batch_bytes = 0
                                if not frames & 0x3FF:
                                    last_activity = self._account(frames, nbytes_total, received)
                                    frames = nbytes_total = 0
                                continue
                            if batch:
                                yield batch
                                last_activity = _resumed(status, received)
                                batch = []
                                add = batch.append
                                batch_bytes = 0
                        start, wal_end, sent = unpack_xlog(buf, 1)
                        if wal_end > received:
                            received = wal_end
                        lsn = new_lsn(LSN, start)
                        frame = new_tuple(
                            XLogData, (lsn, lsn if wal_end == start else new_lsn(LSN, wal_end), sent, buf[PAYLOAD:])
                        )
                        verdict = classify(buf, PAYLOAD, start, end)
                        if verdict == HOLD:
                            self._pending, self._pending_start = frame, bounds.held_at
                            return
                        is_open = bounds.in_transaction or bounds.in_block
                        yield frame
                        last_activity = _resumed(status, received)
                        if verdict == LAST:
                            return
                        if not frames & 0x3FF:
                            last_activity = self._account(frames, nbytes_total, received)
                            frames = nbytes_total = 0
                        continue
                    if buf[0] == KEEPALIVE_TAG:
                        status.received = max(received, status.received)
                        keepalive = status.on_keepalive(buf)
                        received = status.received
                        last_activity = time.monotonic()
                        if keepalive.wal_end >= end and not is_open:
                            return
                        continue
                    raise ProtocolError(
                        f"unexpected replication message type {chr(buf[0])!r}", "check the server version"
                    )
                if nbytes == -1:
                    self._end_of_copy()
                self._account(frames, nbytes_total, received)
                frames = nbytes_total = 0
                last_activity, probed_at = self._idle(last_activity, probed_at)
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None
        finally:
            self.frames += frames
            self.bytes += nbytes_total
            if received > status.received:
                status.received = received

    # -- internals

    def _account(self, frames: int, nbytes: int, received: int) -> float:
        """Add a run of frames to the counters and ``received`` to the position, and send a status
        update if one is due; returns the time."""
        self.frames += frames
        self.bytes += nbytes
        return self._status.send_if_due(received)

    def _idle(self, last_activity: float, probed_at: float) -> tuple[float, float]:
        """Nothing buffered: probe a quiet server, fail a silent one, else wait for the socket.

        Returns the new (last activity, last probe) times.
        """
        now = time.monotonic()
        quiet_since = max(last_activity, probed_at)
        if now - quiet_since >= self.idle_probe:
            # Ask the walsender where it is: it answers with a keepalive carrying wal_end.
            self._status.send(reply_requested=True)
            probed_at = now
            quiet_since = now
        if now - last_activity >= self.idle_timeout:
            raise ConnectionFailure(
                f"no message from the server for {self.idle_timeout:.0f} s",
                "check the server and the network, then retry",
            )
        wait_until = min(self._status.next_due, quiet_since + self.idle_probe, last_activity + self.idle_timeout)
        if libpq_io.wait_readable(self._pgconn, self._poller, wait_until, raise_on_timeout=False):
            last_activity = time.monotonic()
        self._consume()
        return last_activity, probed_at

    def _require_streaming(self) -> None:
        if not self._streaming:
            raise ProtocolError("the replication stream is not started", "call start() first")

    def _lost(self, exc: BaseException) -> PgcdcError:
        self._streaming = False
        return connection_lost(exc)

    def _consume(self) -> None:
        try:
            self._pgconn.consume_input()
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from None

    def _end_of_copy(self) -> None:
        """The server ended COPY BOTH on its own: an error, or a shutdown."""
        self._streaming = False
        error = finish_results(self._pgconn, self._poller, time.monotonic() + 10.0, self._slot)
        if self._pgconn.status == pq.ConnStatus.BAD:
            raise error or ConnectionFailure("replication connection lost", "check the server, then retry")
        self._pgconn.nonblocking = self._saved_nonblocking
        raise error or ConnectionFailure("the server ended the replication stream", "retry once the server is back")
