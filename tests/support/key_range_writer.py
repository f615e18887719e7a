"""Traffic during a snapshot in primary-key ranges: the tables, and a writer thread that inserts,
updates, deletes and moves keys while the snapshot walks its ranges."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

import psycopg

from tests.support.postgres import PgDatabase

ROWS = 4000

DDL = f"""
    CREATE TABLE big (id int PRIMARY KEY, v int, body text);
    ALTER TABLE big ALTER COLUMN body SET STORAGE EXTERNAL;
    INSERT INTO big SELECT g, g, CASE WHEN g % 50 = 0 THEN repeat(md5(g::text), 100) ELSE 'b' || g END
      FROM generate_series(1, {ROWS}) g;
    CREATE TABLE flat (n int, s text);
    INSERT INTO flat SELECT g, 'f' || g FROM generate_series(1, {ROWS}) g;
    CREATE PUBLICATION pub FOR TABLE big, flat;
"""


class Writer(threading.Thread):
    """pgbench-style traffic on ``big`` until stopped: inserts, updates (some keeping the TOASTed
    body), deletes and key moves across ``keys`` (default: the whole key span and beyond), a few per
    transaction, and an insert into the keyless ``flat`` in each (so every drain has something to write)."""

    def __init__(
        self, pg: PgDatabase, seed: int, keys: Sequence[int] = range(1, ROWS + 401), pause: float = 0.004
    ) -> None:
        super().__init__(daemon=True)
        self.pg, self.rng, self.stop = pg, random.Random(seed), threading.Event()
        self.keys = keys  # the keys it inserts, updates, deletes and moves between
        self.pause = pause  # seconds between two transactions
        self.transactions = 0

    def run(self) -> None:
        rng = self.rng
        with self.pg.connect() as conn:
            while not self.stop.wait(self.pause):
                try:
                    with conn.transaction():
                        conn.execute("INSERT INTO flat VALUES (%s, 'w')", (self.transactions,))  # every drain writes
                        for _ in range(rng.randint(1, 3)):
                            key, other = rng.choice(self.keys), rng.choice(self.keys)
                            action = rng.random()
                            if action < 0.25:
                                conn.execute(
                                    "INSERT INTO big VALUES (%s, 0, 'new') ON CONFLICT (id) DO NOTHING", (key,)
                                )
                            elif action < 0.55:
                                conn.execute("UPDATE big SET v = v + 1 WHERE id = %s", (key,))
                            elif action < 0.7:
                                conn.execute("DELETE FROM big WHERE id = %s", (key,))
                            else:
                                conn.execute(
                                    "UPDATE big SET id = %s WHERE id = %s AND NOT EXISTS (SELECT FROM big WHERE id = %s)",
                                    (other, key, other),
                                )
                    self.transactions += 1
                except psycopg.errors.UniqueViolation:
                    continue  # a concurrent-looking move onto a key just inserted: PostgreSQL refused it

    def __enter__(self) -> Writer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.join()
