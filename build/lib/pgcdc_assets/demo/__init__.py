"""``make demo``: pgcdc end to end on a laptop, two pipelines in one Dagster code location.

1. Starts an embedded PostgreSQL 18 (``wal_level=logical``) with its data under ``--dir`` and
   two databases on it: ``shop`` (five related tables with a mix of types, ``page_views``
   without a primary key, a few thousand rows) and ``inventory`` (two small tables), each
   with its publication.
2. Shows a few decoded changes with ``pgcdc changes`` on a scratch slot (then drops it).
3. Writes a dg project under ``--dir``: one pgcdc Component (``defs.yaml``) with the pipelines
   ``shop`` and ``inventory``, DSNs read from the environment (``{{ env('...') }}``), and a
   ``dagster.yaml`` (concurrency pool limit 1: one drain per slot). Creates each slot and runs
   each pipeline's snapshot job (``pgcdc_shop_snapshot``, ``pgcdc_inventory_snapshot``)
   in-process on a persistent Dagster instance at ``DAGSTER_HOME`` (so ``dagster dev`` shows
   the history).
4. ``--runs`` rounds while a load generator per database inserts, updates and deletes in
   small transactions; each round runs each pipeline's incremental job. Each run is verified
   exactly while the load goes on: that database's load pauses just long enough for a
   REPEATABLE READ snapshot to be taken and for the run to fix its end LSN (the slot becomes
   active), so that snapshot holds exactly the transactions the run applies; Delta (read with
   delta-rs) is compared with it value for value (``resources/testing/verify.py``, the
   comparison the tests use). Then each pipeline's reconcile job (``pgcdc_shop_reconcile``,
   ``pgcdc_inventory_reconcile``) runs with the loads still writing, and its checks must pass
   (exact at the LSN it fixes).
5. Stops the loads, runs each pipeline once more, verifies against live PostgreSQL, then
   starts ``dagster dev`` on the project (``--no-dagster``: prints the command instead).

Exit status: 0 when every verification passed, 1 on a mismatch or a failed run, 130 on Ctrl-C.
"""
