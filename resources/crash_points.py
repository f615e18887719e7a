"""Crash points, the one fault-injection seam: ``PGCDC_FAULT_POINT`` names a point where the process kills itself.

The only piece of test machinery the runtime carries: a named point costs one environment lookup
when reached, and a test can then crash a real run exactly there.

Exactly-once has to survive a crash at any instant, and the only honest test of that is a
real SIGKILL (no ``finally`` blocks, no flushing, no goodbye to PostgreSQL). Tests run an
incremental drain in a child process with ``PGCDC_FAULT_POINT`` set to ``point`` or
``point:n``; the first (or the n-th) time the drain reaches that point the process sends itself
SIGKILL, so a test can kill after the k-th of a drain's commits, not only its first. Unset
(always, in production) the check is one dictionary lookup per arrival.

Points (see ``resources/runs/incremental.py``):

* ``before_merge``: changes are decoded and batched, nothing of the chunk is in Delta yet.
* ``after_history_commit``: a changelog commit (docs/history.md) is durable, the table's commit of
  the same changes is not.
* ``after_table_commit``: one Delta write of the drain (a table's MERGE, append or rewrite, one piece of
  a transaction larger than a chunk, a changelog commit, a schema change) is durable and the next is not;
  reached after every such write, so ``after_table_commit:n`` kills between the n-th and the next.
* ``after_delta_commit``: every Delta commit of the chunk is durable, the slot is not confirmed.
* ``after_slot_record``: the position about to be confirmed is recorded in the lake
  (``resources/runs/slot_guard.py``), the slot is not confirmed there: the record is ahead of the slot.
* ``after_confirm``: the slot has been told the chunk's end position.
* ``after_quarantine_record``: a table's fault set it aside and its quarantine record is durable
  (``resources/runs/quarantine.py``); nothing past its unapplied changes is confirmed yet.
* ``before_state_write``: every Delta commit of the run is durable, the pgcdc state table
  (``resources/delta/state_table.py``) not yet written, the last chunk not confirmed.
* ``after_range_slot``: a snapshot in key ranges (``resources/runs/key_range_copy.py``) created the
  temporary slot of its next range, nothing of the range is in Delta yet.
* ``after_range_commit``: the range's Delta commit (with its marker) is durable, the drain that
  follows it has not started.

Snapshot points (``resources/runs/snapshot.py``, ``resources/delta/snapshot_writes.py``; docs/contracts.md,
"Snapshot crash points", says what each leaves and how the next run recovers):

* ``after_snapshot_slot``: a snapshot's temporary slot and transaction exist, nothing is in Delta.
* ``before_snapshot_create``: delta-rs's writer made the table's directory, not yet the table.
* ``after_snapshot_create``: the empty table is created (commit 0: by delta-rs, or on Delta on Spark by
  the engine for delta-rs's rows), no snapshot commit.
* ``during_snapshot_write``: the writer holds the first piece of the rows (either writer, also a key
  range's), nothing of them is committed.
* ``after_snapshot_staged``: the engine's writer staged every piece as Parquet, the engine has not
  written the table.
* ``after_snapshot_commit``: the snapshot commit (or a key range's) is durable; the pgcdc state is not
  written, a staging directory is removed.
* ``before_snapshot_state_write``: every table of the snapshot run is committed, the pgcdc state is not
  written.
"""

from __future__ import annotations

import os
import signal
import threading

FAULT_POINT_ENV = "PGCDC_FAULT_POINT"
FAULT_POINTS = (
    "before_merge",
    "after_history_commit",
    "after_table_commit",
    "after_delta_commit",
    "after_slot_record",
    "after_confirm",
    "after_quarantine_record",
    "before_state_write",
    "after_range_slot",
    "after_range_commit",
    "after_snapshot_slot",
    "before_snapshot_create",
    "after_snapshot_create",
    "during_snapshot_write",
    "after_snapshot_staged",
    "after_snapshot_commit",
    "before_snapshot_state_write",
)


def fault_point(name: str) -> None:
    """Kill this process with SIGKILL if ``PGCDC_FAULT_POINT`` names ``name`` (at its n-th arrival with ``name:n``)."""
    wanted = os.environ.get(FAULT_POINT_ENV)
    if wanted is None:
        return
    point, _, arrival = wanted.partition(":")
    if point != name:
        return
    with _arrivals_lock:  # the writer's threads reach ``after_table_commit`` side by side
        _arrivals[name] = _arrivals.get(name, 0) + 1
        if _arrivals[name] >= int(arrival or 1):
            os.kill(os.getpid(), signal.SIGKILL)


_arrivals: dict[str, int] = {}
"""How often each named point was reached in this process (counted only while one is set)."""
_arrivals_lock = threading.Lock()
