"""A pipeline of several tables of every write mode, one of which (``due``) can be poisoned: the workload
of the quarantine tests (tests/test_quarantine.py, and on Spark tests/test_engines.py)."""

from __future__ import annotations

from tests.support.postgres import PgDatabase

GOOD = ("acct", "events", "pairs")

DDL = """
CREATE TABLE acct (id bigint PRIMARY KEY, owner text);
CREATE TABLE events (kind text, n integer);
CREATE TABLE pairs (a integer, b text);
ALTER TABLE pairs REPLICA IDENTITY FULL;
CREATE TABLE due (id int PRIMARY KEY, due date, n int);
INSERT INTO acct SELECT i, 'owner ' || i FROM generate_series(1, 50) i;
INSERT INTO events VALUES ('a', 1), ('a', 1);
INSERT INTO pairs VALUES (1, 'x'), (1, 'x');
INSERT INTO due SELECT i, date '2026-01-01' + i, i FROM generate_series(1, 20) i;
CREATE PUBLICATION pub FOR TABLE acct, events, pairs, due;
"""


def round_of_changes(pg: PgDatabase, n: int) -> None:
    """Changes to every good table, several transactions, around the poisoned one."""
    pg.execute(
        f"""
        UPDATE acct SET owner = 'round {n}' WHERE id % 3 = {n % 3};
        INSERT INTO acct VALUES ({1000 + n}, 'new {n}');
        INSERT INTO events VALUES ('round', {n}), ('round', {n});
        INSERT INTO pairs VALUES ({n}, 'y');
        UPDATE due SET due = due + 1 WHERE id = 5;
        """
    )
