"""Destination calls on a small pool of background threads, each table's in order, and the durable position they reach.

Delta writes run in the background while the next chunk is decoded and folded (a write waits on the
engine, not on Python). Each write is tagged with its :attr:`OrderedWriter.owner` (the table it
writes, set by the applier around a table's writes), and the owner is its *lane*: the writes of one
table run strictly in the order queued (its changelog before its table, the pieces of one
transaction, the chunks one after another), each only once the one before it succeeded, while the
writes of different tables, each with its own Delta log, run side by side on up to ``concurrency``
threads. The run's own writes (no owner: preparing the engine, a changelog's seed) and every
:meth:`OrderedWriter.call` run behind everything queued before them, and everything queued after
waits for them. On a Spark engine a table's commit is mostly fixed cost (planning, snapshot state,
jobs, the commit: 2 s on Delta on Spark for 10 rows), which the lanes overlap (docs/engine-notes.md).

:attr:`OrderedWriter.durable` advances only past writes taken back in the order they were queued:
a position queued by :meth:`OrderedWriter.durable_after_queued` is durable once every write queued
before it, of every table, completed, so the slot is confirmed only after every table's commit of
the chunk. The caller's thread only waits, calling the heartbeat meanwhile
(:meth:`OrderedWriter.wait`), so the walsender hears from us however long a Delta commit takes.

A failed write of an owned table goes to :attr:`OrderedWriter.on_failure`, which may set that table
aside (quarantine) instead of failing the run; the table's later writes then fail with the same
error without running (its lane is broken: a later commit must never land without an earlier one),
and the other tables' writes go on.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

from resources.crash_points import fault_point

T = TypeVar("T")

HEARTBEAT_SECONDS = 0.1
"""How often a thread waiting for Delta calls the heartbeat (which decides itself whether to send)."""


class OrderedWriter:
    """Queued Destination calls, in order per owner, up to ``concurrency`` at once; :attr:`durable` is the
    newest end LSN all of whose writes (of every owner) completed."""

    def __init__(self, heartbeat: Callable[[], None] | None = None, concurrency: int = 1) -> None:
        self._heartbeat = heartbeat
        self.concurrency = max(1, concurrency)
        self._executor = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="pgcdc-delta-write")
        #: (write, the end LSN durable once it is taken back, its owner, :attr:`since` when it was queued)
        self._in_flight: deque[tuple[Future[None], int | None, object | None, int | None]] = deque()
        #: Each owner's newest queued write: the owner's next write runs only once it succeeded.
        self._lanes: dict[object, Future[None]] = {}
        #: The newest write of the run's own (or :meth:`call`): every later write runs after it.
        self._barrier: Future[None] | None = None
        self._behind = False
        self.durable = 0
        #: The table the writes submitted now belong to (None: the run's own, such as durable marks).
        self.owner: object | None = None
        #: The commit end LSN of the first change the writes submitted now apply (what a failure of one leaves
        #: unapplied), read back as :attr:`failed_since` while ``on_failure`` runs.
        self.since: int | None = None
        self.failed_since: int | None = None
        #: ``on_failure(owner, error)``: whether a failed write of ``owner`` was confined to it (else it fails the run).
        self.on_failure: Callable[[object, Exception], bool] | None = None

    def write(self, operation: Callable[..., None], *args: object, **kwargs: object) -> None:
        """Queue a Delta write: it runs after the writes of its owner queued before it (and after the run's
        own writes), beside other owners' writes. The caller waits only while ``concurrency`` writes are
        unfinished (a bound on the batches held), unless :meth:`next_behind` said to queue at once."""
        self.collect(wait=False)
        if self._behind:
            self._behind = False
            self.write_behind(operation, *args, **kwargs)
            return
        self._make_room()
        self._queue(operation, args, kwargs, behind=False)

    def write_behind(self, operation: Callable[..., None], *args: object, **kwargs: object) -> None:
        """Queue a write right behind its owner's write queued before it without waiting for room (pieces of
        one batch); it runs only if that write succeeded (for the run's own writes: the write queued last)."""
        self._queue(operation, args, kwargs, behind=True)

    def next_behind(self, behind: bool = True) -> None:
        """Whether the next :meth:`write` queues behind the writes in flight without waiting for them: a
        table's write of a batch behind its changelog's write of the same batch, which must succeed first."""
        self._behind = behind

    def _queue(
        self, operation: Callable[..., None], args: tuple[object, ...], kwargs: dict[str, object], behind: bool
    ) -> None:
        """Start ``operation`` once what it must follow is done: its owner's lane (which must have succeeded)
        and the newest barrier; a write of no owner is a barrier behind every write queued before it (and,
        ``behind``, runs only if the write queued last succeeded)."""
        owner = self.owner
        if owner is None:
            after = [future for future, _, _, _ in self._in_flight]
            last = after[-1] if behind and after else None
            future = _chained(self._executor, last, after, _committed_write, operation, args, kwargs)
            self._barrier = future
        else:
            after = [self._barrier] if self._barrier is not None else []
            future = _chained(self._executor, self._lanes.get(owner), after, _committed_write, operation, args, kwargs)
            self._lanes[owner] = future
        self._in_flight.append((future, None, owner, self.since))

    def _make_room(self) -> None:
        """Wait (heartbeat going) until fewer than ``concurrency`` queued writes are unfinished."""
        while True:
            unfinished = [future for future, _, _, _ in self._in_flight if not future.done()]
            if len(unfinished) < self.concurrency:
                return
            self._wait_any(unfinished)
            self.collect(wait=False)

    def _wait_any(self, futures: list[Future[None]]) -> None:
        heartbeat = self._heartbeat
        while not any(future.done() for future in futures):
            if heartbeat is not None:
                heartbeat()
            wait(futures, timeout=HEARTBEAT_SECONDS, return_when=FIRST_COMPLETED)

    def durable_after_queued(self, end: int) -> None:
        """``end`` becomes durable once every write queued so far, of every owner, has completed."""
        if self._in_flight:
            done: Future[None] = Future()
            done.set_result(None)
            self._in_flight.append((done, end, None, None))  # taken back only after every entry before it
        else:
            self.durable = end

    def collect(self, wait: bool) -> None:
        """Take the results of completed writes in the order queued (all of them, waiting, with ``wait``);
        a failed one raises, unless ``on_failure`` confines it to its owner."""
        while self._in_flight and (wait or self._in_flight[0][0].done()):
            self._collect_one()

    def _collect_one(self) -> None:
        future, durable, owner, since = self._in_flight.popleft()
        try:
            self.wait(future)  # a failed write fails the run here, before anything later is confirmed
        except Exception as error:
            self.failed_since = since
            if owner is None or self.on_failure is None or not self.on_failure(owner, error):
                raise
        if durable is not None:
            self.durable = durable
        if owner is not None and self._lanes.get(owner) is future and future.exception() is None:
            del self._lanes[owner]  # its lane is idle: the owner's next write follows nothing (a failed lane stays)
        if self._barrier is future:
            self._barrier = None

    def wait(self, future: Future[T]) -> T:
        """The future's result; calls the heartbeat while waiting, however long a Delta commit takes."""
        heartbeat = self._heartbeat
        if heartbeat is not None:
            while not future.done():
                heartbeat()
                wait((future,), timeout=HEARTBEAT_SECONDS, return_when=FIRST_COMPLETED)
        return future.result()

    def call(self, operation: Callable[..., T], *args: object) -> T:
        """Run a Destination call on a writer thread after every queued write, and wait for its result."""
        self.collect(wait=True)
        return self.wait(self._executor.submit(operation, *args))

    def commit(self, operation: Callable[..., T], *args: object) -> T:
        """:meth:`call` for a Delta write (a schema change, a range's copy): the crash point follows it."""
        return self.call(_committed, operation, *args)

    def close(self) -> None:
        """Wait for the writes queued (a running one cannot be cancelled), then stop the writer threads."""
        for future, _, _, _ in self._in_flight:
            try:
                self.wait(future)
            except Exception:  # noqa: BLE001 - closing after a failure: the failure is already on its way
                continue  # the writes behind it fail without running, or finish: wait for each
        self._executor.shutdown(wait=True)


def _chained(
    executor: ThreadPoolExecutor,
    lane: Future[None] | None,
    after: list[Future[None]],
    run: Callable[..., None],
    operation: Callable[..., None],
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> Future[None]:
    """A future of ``run(operation, *args, **kwargs)``, submitted to ``executor`` once ``lane`` and every
    future of ``after`` are done (no thread waits meanwhile); it fails with ``lane``'s error, not running,
    when ``lane`` failed. ``after`` need only be done: a failed write of another owner is that owner's."""
    result: Future[None] = Future()
    waiting = [future for future in ([lane] if lane is not None else []) + after if not future.done()]
    remaining = [len(waiting)]
    lock = threading.Lock()
    # Taken out when the write starts: a done future keeps its callbacks (and what they hold) for as long as
    # it lives, and a barrier lives through every write queued behind it, so the batches must not be held there.
    call = [(operation, args, kwargs)]

    def start() -> None:
        operation, args, kwargs = call.pop()
        error = lane.exception() if lane is not None else None
        if error is not None:
            result.set_exception(error)
            return
        submitted = executor.submit(run, operation, *args, **kwargs)
        submitted.add_done_callback(lambda done: _copy_outcome(done, result))

    def one_done(_: Future[None]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            start()

    if not waiting:
        start()
    for future in waiting:
        future.add_done_callback(one_done)
    return result


def _copy_outcome(done: Future[None], result: Future[None]) -> None:
    error = done.exception()
    if error is not None:
        result.set_exception(error)
    else:
        result.set_result(None)


def _committed_write(operation: Callable[..., None], *args: object, **kwargs: object) -> None:
    """(Writer thread.) :func:`_committed` of a write whose result is None (the queued writes)."""
    _committed(operation, *args, **kwargs)


def _committed(operation: Callable[..., T], *args: object, **kwargs: object) -> T:
    """(Writer thread.) One Delta write, then the crash point between it and the next (``after_table_commit``)."""
    result = operation(*args, **kwargs)
    fault_point("after_table_commit")
    return result
