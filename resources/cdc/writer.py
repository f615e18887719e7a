"""Destination calls on one background thread, in order, and the durable position they reach.

One Delta write runs in the background while the next chunk is decoded and folded (the write
waits on the engine, not on Python): writes stay in order, and at most one chunk is in flight
besides the one being built. Every Destination call of the applier runs on this thread; the
caller's thread only waits for it, calling the heartbeat meanwhile (:meth:`OrderedWriter.wait`),
so the walsender hears from us however long a Delta commit takes.

Each write is tagged with its :attr:`OrderedWriter.owner` (the table it writes, set by the applier
around a table's writes): a failed write of an owned table goes to :attr:`OrderedWriter.on_failure`,
which may set that table aside (quarantine) instead of failing the run; the writes queued after it
go on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

from resources.crash_points import fault_point

T = TypeVar("T")

HEARTBEAT_SECONDS = 0.1
"""How often a thread waiting for Delta calls the heartbeat (which decides itself whether to send)."""


class OrderedWriter:
    """A one-thread queue of Destination calls; :attr:`durable` is the newest end LSN all of whose writes completed."""

    def __init__(self, heartbeat: Callable[[], None] | None = None) -> None:
        self._heartbeat = heartbeat
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgcdc-delta-write")
        self._in_flight: deque[tuple[Future[None], int | None, object | None]] = deque()
        self._behind = False
        self.durable = 0
        #: The table the writes submitted now belong to (None: the run's own, such as durable marks).
        self.owner: object | None = None
        #: ``on_failure(owner, error)``: whether a failed write of ``owner`` was confined to it (else it fails the run).
        self.on_failure: Callable[[object, Exception], bool] | None = None

    def write(self, operation: Callable[..., None], *args: object, **kwargs: object) -> None:
        """Run a Delta write in the writer thread, after those submitted before it (which must finish
        first, unless :meth:`next_behind` said otherwise)."""
        self.collect(wait=False)
        if self._behind:
            self._behind = False
            self.write_behind(operation, *args, **kwargs)
            return
        while self._in_flight:
            self._collect_one()
        self._in_flight.append((self._executor.submit(_committed_write, operation, *args, **kwargs), None, self.owner))

    def write_behind(self, operation: Callable[..., None], *args: object, **kwargs: object) -> None:
        """Queue a write right behind the one in flight without waiting (pieces of one batch); it runs
        only if the write before it succeeded."""
        before = self._in_flight[-1][0] if self._in_flight else None
        self._in_flight.append((self._executor.submit(_after, before, operation, *args, **kwargs), None, self.owner))

    def next_behind(self, behind: bool = True) -> None:
        """Whether the next :meth:`write` queues behind the writes in flight without waiting for them: a
        table's write of a batch behind its changelog's write of the same batch, which must succeed first."""
        self._behind = behind

    def durable_after_queued(self, end: int) -> None:
        """``end`` becomes durable once every write queued so far has completed."""
        if self._in_flight:
            self._in_flight.append((self._executor.submit(lambda: None), end, None))
        else:
            self.durable = end

    def collect(self, wait: bool) -> None:
        """Take the results of completed writes (all of them, waiting, with ``wait``); a failed one raises."""
        while self._in_flight and (wait or self._in_flight[0][0].done()):
            self._collect_one()

    def _collect_one(self) -> None:
        future, durable, owner = self._in_flight.popleft()
        try:
            self.wait(future)  # a failed write fails the run here, before anything later is confirmed
        except Exception as error:
            if owner is None or self.on_failure is None or not self.on_failure(owner, error):
                raise
        if durable is not None:
            self.durable = durable

    def wait(self, future: Future[T]) -> T:
        """The future's result; calls the heartbeat while waiting, however long a Delta commit takes."""
        heartbeat = self._heartbeat
        if heartbeat is not None:
            while not future.done():
                heartbeat()
                wait((future,), timeout=HEARTBEAT_SECONDS, return_when=FIRST_COMPLETED)
        return future.result()

    def call(self, operation: Callable[..., T], *args: object) -> T:
        """Run a Destination call on the writer thread after every queued write, and wait for its result."""
        self.collect(wait=True)
        return self.wait(self._executor.submit(operation, *args))

    def commit(self, operation: Callable[..., T], *args: object) -> T:
        """:meth:`call` for a Delta write (a schema change, a range's copy): the crash point follows it."""
        return self.call(_committed, operation, *args)

    def close(self) -> None:
        """Wait for a write in flight (it cannot be cancelled), then stop the writer thread."""
        for future, _, _ in self._in_flight:
            try:
                self.wait(future)
            except Exception:  # noqa: BLE001 - closing after a failure: the failure is already on its way
                break
        self._executor.shutdown(wait=True)


def _after(before: Future[None] | None, operation: Callable[..., None], *args: object, **kwargs: object) -> None:
    """(Writer thread.) ``operation`` once the write before it (done already: one thread, in order) succeeded."""
    if before is not None:
        before.result()
    _committed_write(operation, *args, **kwargs)


def _committed_write(operation: Callable[..., None], *args: object, **kwargs: object) -> None:
    """(Writer thread.) :func:`_committed` of a write whose result is None (the queued writes)."""
    _committed(operation, *args, **kwargs)


def _committed(operation: Callable[..., T], *args: object, **kwargs: object) -> T:
    """(Writer thread.) One Delta write, then the crash point between it and the next (``after_table_commit``)."""
    result = operation(*args, **kwargs)
    fault_point("after_table_commit")
    return result
