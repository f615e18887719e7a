"""Per-table locks between pgcdc's runs, held where the runs are: advisory locks on the publisher.

Runs of one pipeline that write the same Delta table must not overlap, with or without Dagster's
concurrency pool: a drain that writes table T against a snapshot of T (first or again) and against
the maintenance of T. Each such run takes a PostgreSQL advisory lock on its own session of the
publisher, keyed by (pipeline slot, the table's Delta path: what two runs must not write at once): a drain takes it *shared*, when it first meets a change of
T (so drains never wait for each other here, and a re-snapshot of T waits only for drains that write
T); a snapshot or maintenance of T takes it *exclusive*. Two drains of one slot are kept apart by the
slot itself (one walsender at a time, ``resources/postgres/slots.py: slot_in_use``).

A lock is session-level, so a run that dies (its process killed, its node lost) releases it as its
connection closes: nothing to clean up. The session's ``application_name`` names the run
(``pgcdc <what> <run>``), so a run that cannot get a lock within its bound says which run holds it.
Keys are 31-bit CRC32s of the slot and of the Delta path: two tables sharing a key only wait for each
other needlessly, never run together.
"""

from __future__ import annotations

import contextvars
import os
import socket
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg

from resources.errors import PgcdcError
from resources.postgres.connections import connect

DEFAULT_LOCK_WAIT_SECONDS = 60.0
"""How long a run waits for a table another run holds before it refuses, naming that run."""

POLL_SECONDS = 0.2

RUN_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar("pgcdc_run_name", default=None)
"""The run's name in the locks' sessions (a Dagster op sets it to its run id); unset: this process."""


class TableBusyError(PgcdcError):
    """Another pgcdc run holds a table this run must write."""


def run_name() -> str:
    """The name of this run as other runs see it: :data:`RUN_NAME`, else this process."""
    return RUN_NAME.get() or f"pid {os.getpid()} on {socket.gethostname()}"


def table_key(slot: str, path: str) -> tuple[int, int]:
    """The advisory lock's two int4 keys: the pipeline (its slot) and the table's Delta path."""
    return zlib.crc32(f"pgcdc slot {slot}".encode()) & 0x7FFFFFFF, zlib.crc32(path.encode()) & 0x7FFFFFFF


class TableLocks:
    """One run's table locks, on one session of its own (opened on first use, closed by :meth:`close`)."""

    def __init__(self, dsn: str, slot: str, what: str, wait_seconds: float | None = None) -> None:
        """``wait_seconds``: how long :meth:`acquire` waits for a table another run holds (None:
        :data:`DEFAULT_LOCK_WAIT_SECONDS` as it is now)."""
        self._dsn = dsn
        self._slot = slot
        self._what = what
        self.run = run_name()
        self._wait = DEFAULT_LOCK_WAIT_SECONDS if wait_seconds is None else wait_seconds
        self._conn: psycopg.Connection | None = None
        self.held: dict[str, bool] = {}  # Delta path -> exclusive

    def _session(self) -> psycopg.Connection:
        if self._conn is None:
            self._conn = connect(self._dsn, application_name=f"pgcdc {self._what} {self.run}"[:63])
        return self._conn

    def acquire(self, table: str, *, exclusive: bool, heartbeat: Callable[[], None] | None = None) -> None:
        """Take the lock of the Delta table at path ``table``, waiting up to the bound (calling ``heartbeat`` meanwhile); refuse in one
        line naming the run that holds it."""
        if table in self.held:
            return
        function = "pg_try_advisory_lock" if exclusive else "pg_try_advisory_lock_shared"
        deadline = time.monotonic() + self._wait
        while True:
            ((taken,),) = (
                self._session()
                .execute(
                    f"SELECT pg_catalog.{function}(%s::pg_catalog.int4, %s::pg_catalog.int4)",
                    table_key(self._slot, table),
                )
                .fetchall()
            )
            if taken:
                self.held[table] = exclusive
                return
            if time.monotonic() >= deadline:
                raise self._busy(table)
            if heartbeat is not None:
                heartbeat()
            time.sleep(POLL_SECONDS)

    def release(self, table: str) -> None:
        exclusive = self.held.pop(table, None)
        if exclusive is None or self._conn is None:
            return
        function = "pg_advisory_unlock" if exclusive else "pg_advisory_unlock_shared"
        self._conn.execute(
            f"SELECT pg_catalog.{function}(%s::pg_catalog.int4, %s::pg_catalog.int4)", table_key(self._slot, table)
        )

    @contextmanager
    def holding(self, table: str) -> Iterator[None]:
        """The table's lock held exclusively for the block (a snapshot or maintenance of it)."""
        self.acquire(table, exclusive=True)
        try:
            yield
        finally:
            self.release(table)

    def close(self) -> None:
        """End the session, which releases every lock it holds."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.held.clear()

    def _busy(self, table: str) -> TableBusyError:
        """The refusal, naming the sessions (runs) that hold the table's lock."""
        classid, objid = table_key(self._slot, table)
        holders = (
            self._session()
            .execute(
                "SELECT a.application_name, a.pid, a.backend_start::pg_catalog.timestamptz(0)::pg_catalog.text"
                " FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a ON a.pid OPERATOR(pg_catalog.=) l.pid"
                " WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' AND l.granted"
                " AND l.classid OPERATOR(pg_catalog.=) %s::pg_catalog.int8::pg_catalog.oid"
                " AND l.objid OPERATOR(pg_catalog.=) %s::pg_catalog.int8::pg_catalog.oid"
                " AND l.objsubid OPERATOR(pg_catalog.=) 2",
                (classid, objid),
            )
            .fetchall()
        )
        named = ", ".join(f"{app or 'a session'} (PID {pid}, since {since})" for app, pid, since in holders)
        return TableBusyError(
            f"the Delta table {table} is being written by another pgcdc run: {named or 'a run that just ended'}; this "
            f"{self._what} waited {self._wait:.0f} s for it",
            "run this again once that run has finished (a run whose process is gone releases the table "
            "when PostgreSQL ends its session: pg_terminate_backend(PID))",
        )
