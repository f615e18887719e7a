"""``make demo``: pgcdc end to end on a laptop, driven through Dagster.

1. Starts an embedded PostgreSQL 18 (``wal_level=logical``) with its data under ``--dir``,
   creates a small shop schema (five related tables with a mix of types, ``page_views``
   without a primary key) and seeds a few thousand rows; creates the publication.
2. Shows a few decoded changes with ``pgcdc changes`` on a scratch slot (then drops it).
3. Writes the pgcdc YAML and a ``dagster.yaml`` (concurrency pool limit 1) under ``--dir``,
   creates the permanent slot, and materializes the ``pgcdc_snapshot`` job in-process on a
   persistent Dagster instance at ``DAGSTER_HOME`` (so ``dagster dev`` shows the history).
4. Runs ``pgcdc_incremental`` ``--runs`` times while a load generator thread inserts,
   updates and deletes in small transactions. Each run is verified exactly while the load
   goes on: the load pauses just long enough for a REPEATABLE READ snapshot to be taken and
   for the run to fix its end LSN (the slot becomes active), so that snapshot holds exactly
   the transactions the run applies; Delta (read with delta-rs) is compared with it value for
   value (``resources/testing/verify.py``, the comparison the tests use). Then ``pgcdc_reconcile``
   runs with the load still writing, and its checks must pass (exact at the LSN it fixes).
5. Stops the load, runs once more, verifies against live PostgreSQL, then starts
   ``dagster dev`` on the same configuration (``--no-dagster``: prints the command instead).

Exit status: 0 when every verification passed, 1 on a mismatch or a failed run, 130 on Ctrl-C.
"""
