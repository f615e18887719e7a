"""The applier's writer (``resources/cdc/writer.py``): tables' writes side by side, each table's in order,
the durable position behind all of them, a failed table's lane stopped while the others go on."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from resources.cdc.writer import OrderedWriter

TIMEOUT = 10.0


def _waiter(event: threading.Event, done: list[str], name: str) -> Callable[[], None]:
    def run() -> None:
        assert event.wait(TIMEOUT), f"{name} waited in vain"
        done.append(name)

    return run


def test_writes_of_two_tables_run_side_by_side_and_durable_waits_for_both() -> None:
    """Table a's write can finish only once table b's has run: with two threads both run at once, and
    the chunk's end becomes durable only after both."""
    b_ran, done = threading.Event(), []
    writer = OrderedWriter(concurrency=2)
    try:
        writer.owner = "a"
        writer.write(_waiter(b_ran, done, "a"))
        writer.owner = "b"
        writer.write(lambda: (done.append("b"), b_ran.set()))
        writer.owner = None
        writer.durable_after_queued(7)
        writer.collect(wait=True)
        assert done == ["b", "a"] and writer.durable == 7
    finally:
        writer.close()


def test_the_writes_of_one_table_stay_in_order_and_behind_the_runs_own() -> None:
    done: list[str] = []
    writer = OrderedWriter(concurrency=4)
    try:
        writer.write(lambda: done.append("prepare"))  # the run's own write (no owner): everything follows it
        for i in range(5):
            writer.owner = "t"
            writer.write(lambda i=i: done.append(f"t{i}"))
            writer.next_behind()
            writer.write(lambda i=i: done.append(f"t{i}-behind"))
            writer.owner = "u"
            writer.write(lambda i=i: done.append(f"u{i}"))
        writer.owner = None
        assert writer.call(lambda: list(done))[:1] == ["prepare"]  # a call runs after every queued write
        assert [name for name in done if name.startswith("t")] == [
            name for i in range(5) for name in (f"t{i}", f"t{i}-behind")
        ]
        assert [name for name in done if name.startswith("u")] == [f"u{i}" for i in range(5)]
    finally:
        writer.close()


def test_a_failed_write_stops_its_table_and_the_others_go_on() -> None:
    """The failure goes to on_failure with its owner; that table's later writes do not run (a later commit
    must not land without an earlier one), the other table's do, and durable moves past all of them."""
    done: list[str] = []
    failures: list[tuple[object, str]] = []
    writer = OrderedWriter(concurrency=2)
    writer.on_failure = lambda owner, error: failures.append((owner, str(error))) is None

    def fail() -> None:
        raise ValueError("the engine refused it")

    try:
        writer.owner = "bad"
        writer.write(fail)
        writer.write(lambda: done.append("bad later"))
        writer.owner = "good"
        writer.write(lambda: done.append("good"))
        writer.write(lambda: done.append("good later"))
        writer.owner = None
        writer.durable_after_queued(9)
        writer.collect(wait=True)
        assert done == ["good", "good later"] and writer.durable == 9
        assert failures == [("bad", "the engine refused it"), ("bad", "the engine refused it")]
    finally:
        writer.close()


def test_a_failure_not_confined_to_its_table_fails_the_run_before_durable_moves() -> None:
    writer = OrderedWriter(concurrency=2)
    writer.on_failure = lambda owner, error: False

    def fail() -> None:
        raise ValueError("the lake is gone")

    try:
        writer.owner = "t"
        writer.write(fail)
        writer.owner = None
        writer.durable_after_queued(5)
        with pytest.raises(ValueError, match="the lake is gone"):
            writer.collect(wait=True)
        assert writer.durable == 0
    finally:
        writer.close()
