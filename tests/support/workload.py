"""A seeded random workload for pgcdc: SQL transactions interleaved with incremental runs.

:func:`generate` turns a seed into a list of :class:`Step` s without touching a server, so a
seed is replayed exactly (``PGCDC_SEED``, see ``tests/test_randomized.py``) and every step
prints as the SQL it runs. The generator tracks each table's columns (ADD/DROP COLUMN, also
inside transactions that roll back) and which tables are published and snapshotted; every
statement is built so it cannot fail (conflict-free key moves, ``ON CONFLICT``, key ranges
that concurrent transactions never share), so an error while executing is a finding.

Tables (``TABLES``):

* ``k_int``   int primary key, many types (float4, uuid[], jsonb[], numeric[] among them), ``body`` text with
              STORAGE EXTERNAL (TOASTed)
* ``k_comp``  composite (text, bigint) primary key, float8 / date / bytea
* ``k_uuid``  uuid primary key
* ``full_t``  no key, REPLICA IDENTITY FULL, TOASTable ``b``, float4 and float8 columns (rows kept distinct:
              ``a`` is unique)
* ``dup_t``   no key, REPLICA IDENTITY FULL, values from a small domain (NULLs, TOASTed ``b``, float4 0, -0, NaN), so
              most rows have identical copies; changes hit one copy (by ctid) or all of them
* ``log_t``   no key, default identity: insert-only (appends) and TRUNCATE
* ``late``    bigint key, added to the publication mid-stream, snapshotted later

Key ranges of ``k_int``: 0..199 small DML, 1000..1199 where keys move to and back,
2000..4999 large (streamed) transactions, 5000..6999 transactions left open across a run,
7000..8999 prepared transactions left pending across a run.
"""

from __future__ import annotations

import copy
import random
import uuid
from dataclasses import dataclass, field
from decimal import Decimal

OPEN_RANGE = (5000, 7000)
PREPARED_RANGE = (7000, 9000)


# --------------------------------------------------------------------------- values


def _text(rng: random.Random) -> str:
    pool = ["plain", "", "it''s", "back\\slash", "línea\nnueva", "😀 emoji", "tab\there", "  spaces  ", "NULL", "ça"]
    word = rng.choice(pool)
    return f"'{word}{rng.randint(0, 999) if rng.random() < 0.7 else ''}'"


def _toast(rng: random.Random) -> str:
    """Large values go out of line (STORAGE EXTERNAL, no compression); small ones stay inline."""
    r = rng.random()
    n = rng.randint(0, 10_000)
    if r < 0.5:
        return f"repeat(md5('{n}'), {rng.randint(70, 400)})"  # 2 kB .. 13 kB: TOASTed
    if r < 0.6:
        return "NULL"
    return f"'short {n}'"


VALUE_MAKERS = {
    "int": lambda r: str(r.choice([0, -1, 2**31 - 1, -(2**31), r.randint(-1000, 1000)])),
    "bigint": lambda r: str(r.choice([2**63 - 1, -(2**63), r.randint(-(10**12), 10**12)])),
    "text": _text,
    "numeric": lambda r: str(Decimal(r.randint(-(10**9), 10**9)).scaleb(-3)),
    "numeric2": lambda r: str(Decimal(r.randint(-(10**7), 10**7)).scaleb(-2)),
    "ts": lambda r: r.choice(
        ["'infinity'::timestamptz", "'-infinity'::timestamptz"]
        + [f"'2024-03-01 12:00:00+00'::timestamptz + interval '{r.randint(-(10**9), 10**9)} microseconds'"] * 8
    ),
    "bool": lambda r: r.choice(["true", "false"]),
    "jsonb": lambda r: r.choice(
        [f"""'{{"k": {r.randint(0, 99)}, "s": "x\\"y"}}'::jsonb""", "'[1, \"two\", null]'::jsonb", "'null'::jsonb"]
    ),
    "intarr": lambda r: r.choice(["'{}'::int[]", f"ARRAY[{r.randint(-9, 9)}, NULL, {r.randint(0, 99)}]::int[]"]),
    "float": lambda r: f"{r.randint(-(10**6), 10**6) / 8}::float8",
    "date": lambda r: f"'2024-01-01'::date + {r.randint(-20000, 20000)}",
    "bytea": lambda r: r.choice(["'\\x'::bytea", f"'\\x00ff{r.randint(0, 255):02x}'::bytea"]),
    "toast": _toast,
    "uuid": lambda r: f"'{uuid.UUID(int=r.getrandbits(128))}'::uuid",
    # float4 as Delta's float32: shortest texts that are not float8's, NaN, -0 and the infinities
    "float4": lambda r: (
        r.choice(["'NaN'", "'-0'", "'Infinity'", "'-Infinity'"] + [f"{r.randint(-(10**6), 10**6) / 10}"] * 6)
        + "::float4"
    ),
    # arrays whose elements Delta holds as PostgreSQL's text: NULL elements, quoting, empty arrays
    "uuidarr": lambda r: r.choice(
        [
            "'{}'::uuid[]",
            f"ARRAY['{uuid.UUID(int=r.getrandbits(128))}'::uuid, NULL, '{uuid.UUID(int=r.getrandbits(128))}']",
        ]
    ),
    "jsonbarr": lambda r: r.choice(
        ["'{}'::jsonb[]", f"""ARRAY['{{"k": {r.randint(0, 9)}, "q": "a,b\\"c"}}'::jsonb, NULL, '[1, "x y"]']"""]
    ),
    "numarr": lambda r: r.choice(
        ["'{}'::numeric[]", f"ARRAY[{r.randint(-999, 999)}.50, NULL, 'NaN', 1e-20, {r.randint(0, 9)}]::numeric[]"]
    ),
}

DUPLICATE_DOMAINS = {
    "dup_k": ["NULL", "0", "1", "2"],
    "dup_b": ["NULL", "'x'", "repeat(md5('d1'), 200)", "repeat(md5('d2'), 300)"],  # 6-10 kB: TOASTed
    "dup_n": ["NULL", "1.00", "2.50"],
    # equal in PostgreSQL, printed apart: REPLICA IDENTITY FULL must match the copy the change names
    "dup_f": ["NULL", "0", "'-0'", "'NaN'", "0.1"],
}
"""Values of dup_t's columns: few, so rows repeat."""

ADDED_TYPES = {
    "int": "int",
    "bigint": "bigint",
    "text": "text",
    "numeric2": "numeric(10,2)",
    "ts": "timestamptz",
    "bool": "boolean",
    "jsonb": "jsonb",
    "float": "float8",
    "date": "date",
}


def value(rng: random.Random, kind: str, nullable: bool = True) -> str:
    if kind in DUPLICATE_DOMAINS:
        return rng.choice(DUPLICATE_DOMAINS[kind])
    if nullable and rng.random() < 0.1:
        return "NULL"
    return VALUE_MAKERS[kind](rng)


# --------------------------------------------------------------------------- schema model


@dataclass
class Table:
    name: str
    kind: str  # keyed | full | dups | append
    key: list[str]
    columns: dict[str, str]  # name -> value kind, current columns in order
    published: bool = True
    snapshotted: bool = True
    dropped: set[str] = field(default_factory=set)  # ever dropped: may linger in Delta

    @property
    def non_key(self) -> list[str]:
        return [c for c in self.columns if c not in self.key]


DDL = """
CREATE TABLE k_int (id int PRIMARY KEY, name text, n bigint, amt numeric(12,3), ts timestamptz, flag boolean,
                    doc jsonb, tags int[], body text, f4 real, ids uuid[], docs jsonb[], nums numeric[]);
ALTER TABLE k_int ALTER COLUMN body SET STORAGE EXTERNAL;
CREATE TABLE k_comp (region text, code bigint, val float8, d date, payload bytea, note text, PRIMARY KEY (region, code));
CREATE TABLE k_uuid (id uuid PRIMARY KEY, v int, note varchar(40));
CREATE TABLE full_t (a int, b text, c numeric(8,2), f real, g float8);
ALTER TABLE full_t REPLICA IDENTITY FULL;
ALTER TABLE full_t ALTER COLUMN b SET STORAGE EXTERNAL;
CREATE TABLE dup_t (k int, b text, n numeric(8,2), f real);
ALTER TABLE dup_t REPLICA IDENTITY FULL;
ALTER TABLE dup_t ALTER COLUMN b SET STORAGE EXTERNAL;
CREATE TABLE log_t (kind text, n int, at timestamptz);
CREATE TABLE late (id bigint PRIMARY KEY, v text, body text);
ALTER TABLE late ALTER COLUMN body SET STORAGE EXTERNAL;
INSERT INTO k_int SELECT g, 'seed' || g, g::bigint * 1000000007, g / 7.0, '2024-01-01'::timestamptz + g * interval '1 hour',
                         g % 2 = 0, jsonb_build_object('g', g), ARRAY[g], CASE WHEN g % 3 = 0 THEN repeat(md5(g::text), 200) END,
                         g / 10.0, ARRAY[md5(g::text)::uuid], ARRAY[jsonb_build_object('g', g)], ARRAY[g / 3.0]
  FROM generate_series(0, 149) g;
INSERT INTO k_comp SELECT r, g, g / 4.0, '2024-01-01'::date + g, '\\x0102', NULL
  FROM unnest(ARRAY['eu', 'us', 'ap']) r, generate_series(0, 19) g;
INSERT INTO k_uuid SELECT md5(g::text)::uuid, g, 'seed' FROM generate_series(0, 39) g;
INSERT INTO full_t SELECT g, CASE WHEN g % 4 = 0 THEN repeat(md5(g::text), 150) ELSE 'b' || g END, g, g / 10.0, g / 3.0
  FROM generate_series(0, 59) g;
INSERT INTO dup_t SELECT NULLIF(g % 3, 2), CASE g % 4 WHEN 0 THEN repeat(md5('d1'), 200) WHEN 1 THEN 'x' END,
                         CASE WHEN g % 2 = 0 THEN 1.00 END
  FROM generate_series(0, 47) g;
INSERT INTO log_t VALUES ('seed', 1, NULL), ('seed', 1, NULL);
INSERT INTO late SELECT g, 'early' || g, repeat(md5(g::text), 100) FROM generate_series(0, 29) g;
CREATE PUBLICATION pub FOR TABLE k_int, k_comp, k_uuid, full_t, dup_t, log_t;
"""

FULL_T_SEED_ROWS = 60


def initial_tables() -> dict[str, Table]:
    return {
        "k_int": Table(
            "k_int",
            "keyed",
            ["id"],
            {
                "id": "int",
                "name": "text",
                "n": "bigint",
                "amt": "numeric",
                "ts": "ts",
                "flag": "bool",
                "doc": "jsonb",
                "tags": "intarr",
                "body": "toast",
                "f4": "float4",
                "ids": "uuidarr",
                "docs": "jsonbarr",
                "nums": "numarr",
            },
        ),
        "k_comp": Table(
            "k_comp",
            "keyed",
            ["region", "code"],
            {"region": "text", "code": "bigint", "val": "float", "d": "date", "payload": "bytea", "note": "text"},
        ),
        "k_uuid": Table("k_uuid", "keyed", ["id"], {"id": "uuid", "v": "int", "note": "text"}),
        "full_t": Table("full_t", "full", [], {"a": "int", "b": "toast", "c": "numeric2", "f": "float4", "g": "float"}),
        "dup_t": Table("dup_t", "dups", [], {"k": "dup_k", "b": "dup_b", "n": "dup_n", "f": "dup_f"}),
        "log_t": Table("log_t", "append", [], {"kind": "text", "n": "int", "at": "ts"}),
        "late": Table(
            "late", "keyed", ["id"], {"id": "bigint", "v": "text", "body": "toast"}, published=False, snapshotted=False
        ),
    }


# --------------------------------------------------------------------------- steps


@dataclass
class Step:
    """One thing the executor does. ``kind``:

    * ``sql``: run ``statements`` on connection ``conn`` (0: main, 1: the second connection);
      a transaction is spelled out with BEGIN/COMMIT/ROLLBACK/PREPARE TRANSACTION statements.
    * ``run``: ``run_incremental`` with ``chunk`` = max_chunk_changes, then the oracle.
    * ``snapshot``: ``snapshot_tables`` for ``table``.
    """

    kind: str
    statements: list[str] = field(default_factory=list)
    conn: int = 0
    chunk: int = 0
    table: str = ""
    note: str = ""
    # The oracle's view after this step: table name -> (key, columns that may linger in Delta).
    checks: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)

    def render(self) -> str:
        if self.kind == "sql":
            who = "" if self.conn == 0 else "[conn 2] "
            body = "; ".join(self.statements)
            return f"{who}{self.note + ': ' if self.note else ''}{body}"
        if self.kind == "run":
            return f"run_incremental(max_chunk_changes={self.chunk}) then oracle on {sorted(self.checks)}"
        return f"snapshot_tables([{self.table}]){' (' + self.note + ')' if self.note else ''}"


class Generator:
    def __init__(self, seed: int, ops: int) -> None:
        self.rng = random.Random(seed)
        self.ops = ops
        self.tables = initial_tables()
        self.next_a = FULL_T_SEED_ROWS  # full_t.a values are never reused: rows stay distinct
        self.next_column = 0
        self.next_gid = 0
        self.open_txn = False  # conn 2 holds an open transaction (OPEN_RANGE / log_t only)
        self.pending_gid: str | None = None  # a prepared transaction (PREPARED_RANGE only)
        self.heavy = False  # a transaction of thousands of changes since the last run
        self.steps: list[Step] = []

    # ---------------------------------------------------------------- plumbing

    @property
    def busy(self) -> bool:
        """Something holds locks: no DDL, TRUNCATE, snapshot or publication change now."""
        return self.open_txn or self.pending_gid is not None

    def sql(self, statements: list[str], note: str = "", conn: int = 0) -> None:
        self.steps.append(Step("sql", statements, conn=conn, note=note))

    def checks(self) -> dict[str, tuple[list[str], list[str]]]:
        return {t.name: (t.key, sorted(t.dropped)) for t in self.tables.values() if t.published and t.snapshotted}

    def run(self, chunk: int | None = None) -> None:
        if chunk is None:
            # Tiny chunks make a Delta commit every few changes: only for backlogs without a
            # transaction of thousands of changes, which would take minutes at that rate.
            sizes = [300, 1000, 200_000] if self.heavy else [1, 2, 3, 5, 8, 20, 100, 200_000]
            chunk = self.rng.choice(sizes)
        self.heavy = False
        self.steps.append(Step("run", chunk=chunk, checks=self.checks()))

    # ---------------------------------------------------------------- DML per table

    def _keyed_row(self, t: Table, key: list[str]) -> str:
        values = key + [value(self.rng, kind) for c, kind in t.columns.items() if c not in t.key]
        return "(" + ", ".join(values) + ")"

    def _key_values(self, t: Table, lo: int = 0, hi: int = 199) -> list[str]:
        r = self.rng
        if t.name == "k_comp":
            return [f"'{r.choice(['eu', 'us', 'ap', 'ça'])}'", str(r.randint(0, 29))]
        if t.name == "k_uuid":
            return [f"md5('{r.randint(0, 59)}')::uuid"]
        return [str(r.randint(lo, hi))]

    def _columns_sql(self, t: Table) -> str:
        return "(" + ", ".join(t.columns) + ")"

    def _set_clause(self, t: Table, allow_toast: bool = True) -> str:
        cols = [
            c for c in t.non_key if (allow_toast or t.columns[c] != "toast") and not (t.kind == "full" and c == "a")
        ]
        if not cols:
            cols = [c for c in t.non_key if not (t.kind == "full" and c == "a")]
        chosen = self.rng.sample(cols, k=self.rng.randint(1, min(3, len(cols))))
        return ", ".join(f"{c} = {value(self.rng, t.columns[c])}" for c in chosen)

    def _where_range(self, t: Table) -> str:
        r = self.rng
        if t.name == "k_int":
            lo = r.randint(0, 199)
            base = r.choice([0, 0, 1000])
            return f"id BETWEEN {base + lo} AND {base + lo + r.randint(0, 8)}"
        if t.name == "k_comp":
            return f"region = '{r.choice(['eu', 'us', 'ap', 'ça'])}' AND code BETWEEN {(lo := r.randint(0, 29))} AND {lo + r.randint(0, 5)}"
        if t.name == "k_uuid":
            return f"v BETWEEN {(lo := r.randint(-1000, 1000))} AND {lo + r.randint(0, 100)}"
        if t.name == "late":
            return f"id BETWEEN {(lo := r.randint(0, 99))} AND {lo + r.randint(0, 10)}"
        lo = r.randint(0, max(0, self.next_a - 1))
        return f"a BETWEEN {lo} AND {lo + r.randint(0, 8)}"

    def dml(self, t: Table) -> list[str]:
        """One statement that cannot fail."""
        r = self.rng
        name = t.name
        if t.kind == "append":
            if r.random() < 0.05:
                self.heavy = True
                return [
                    f"INSERT INTO log_t {self._columns_sql(t)} SELECT {', '.join(self._append_values(t))}"
                    f" FROM generate_series(1, {r.randint(10, 300)})"
                ]
            row = "(" + ", ".join(self._append_values(t)) + ")"
            return [f"INSERT INTO log_t {self._columns_sql(t)} VALUES {', '.join([row] * r.randint(1, 3))}"]
        if t.kind == "dups":
            return [self._duplicates_dml(t)]
        if t.kind == "full":
            x = r.random()
            if x < 0.45:
                rows = []
                for _ in range(r.randint(1, 4)):
                    rows.append(
                        "("
                        + ", ".join([str(self.next_a)] + [value(r, kind) for c, kind in t.columns.items() if c != "a"])
                        + ")"
                    )
                    self.next_a += 1
                return [f"INSERT INTO full_t {self._columns_sql(t)} VALUES {', '.join(rows)}"]
            if x < 0.55:
                # Unchanged TOAST in the new image: b is not set.
                return [
                    f"UPDATE full_t SET {self._set_clause(t, allow_toast=r.random() < 0.4)} WHERE {self._where_range(t)}"
                ]
            if x < 0.7:
                old = r.randint(0, max(0, self.next_a - 1))
                self.next_a += 1
                return [f"UPDATE full_t SET a = {self.next_a - 1} WHERE a = {old}"]
            return [f"DELETE FROM full_t WHERE {self._where_range(t)}"]
        x = r.random()
        cols = self._columns_sql(t)
        key = ", ".join(t.key)
        if x < 0.42:
            rows = [self._keyed_row(t, self._key_values(t)) for _ in range(r.randint(1, 4))]
            if r.random() < 0.5:  # several rows; a key repeated in the statement is skipped
                return [f"INSERT INTO {name} {cols} VALUES {', '.join(rows)} ON CONFLICT ({key}) DO NOTHING"]
            sets = ", ".join(f"{c} = EXCLUDED.{c}" for c in r.sample(t.non_key, k=r.randint(1, len(t.non_key))))
            return [f"INSERT INTO {name} {cols} VALUES {rows[0]} ON CONFLICT ({key}) DO UPDATE SET {sets}"]
        if x < 0.67:
            # Updates mostly leave the TOASTed column alone: its value arrives as unchanged TOAST.
            return [
                f"UPDATE {name} SET {self._set_clause(t, allow_toast=r.random() < 0.3)} WHERE {self._where_range(t)}"
            ]
        if x < 0.82:
            return self._key_change(t)
        return [f"DELETE FROM {name} WHERE {self._where_range(t)}"]

    def _duplicates_dml(self, t: Table) -> str:
        """dup_t: inserts of rows that often exist already, updates and deletes of one copy among
        several (picked by ctid) or of every copy; updates mostly leave the TOASTed ``b`` alone."""
        r = self.rng

        def row() -> str:
            return "(" + ", ".join(value(r, kind) if r.random() < 0.5 else "NULL" for kind in t.columns.values()) + ")"

        match = f"k IS NOT DISTINCT FROM {value(r, 'dup_k')}"
        one_copy = f"ctid IN (SELECT ctid FROM dup_t WHERE {match} LIMIT 1)"
        column = r.choice([c for c in t.columns if c != "b"] if r.random() < 0.75 else list(t.columns))
        x = r.random()
        if x < 0.35:
            rows = [row()] * r.randint(1, 3) if r.random() < 0.5 else [row() for _ in range(r.randint(1, 4))]
            return f"INSERT INTO dup_t {self._columns_sql(t)} VALUES {', '.join(rows)}"
        if x < 0.55:
            return f"UPDATE dup_t SET {column} = {value(r, t.columns[column])} WHERE {one_copy}"
        if x < 0.65:
            return f"UPDATE dup_t SET {column} = {value(r, t.columns[column])} WHERE {match}"
        if x < 0.9:
            return f"DELETE FROM dup_t WHERE {one_copy}"
        return f"DELETE FROM dup_t WHERE {match} AND n IS NULL"

    def _append_values(self, t: Table) -> list[str]:
        return [value(self.rng, kind) for kind in t.columns.values()]

    def _key_change(self, t: Table) -> list[str]:
        r = self.rng
        name = t.name
        if name == "k_int":
            if r.random() < 0.5:  # one row to a free key, maybe changing other columns too
                old, new = r.randint(0, 199), r.choice([r.randint(0, 199), r.randint(1000, 1199)])
                extra = f", {self._set_clause(t, allow_toast=r.random() < 0.3)}" if r.random() < 0.3 else ""
                return [
                    f"UPDATE k_int SET id = {new}{extra} WHERE id = {old}"
                    f" AND NOT EXISTS (SELECT 1 FROM k_int WHERE id = {new})"
                ]
            lo = r.randint(0, 199)
            hi = lo + r.randint(0, 20)
            if r.random() < 0.5:
                return [
                    f"UPDATE k_int t SET id = id + 1000 WHERE id BETWEEN {lo} AND {hi}"
                    " AND NOT EXISTS (SELECT 1 FROM k_int u WHERE u.id = t.id + 1000)"
                ]
            return [
                f"UPDATE k_int t SET id = id - 1000 WHERE id BETWEEN {lo + 1000} AND {hi + 1000}"
                " AND NOT EXISTS (SELECT 1 FROM k_int u WHERE u.id = t.id - 1000)"
            ]
        if name == "k_comp":
            region, new_region = r.choice(["eu", "us", "ap", "ça"]), r.choice(["eu", "us", "ap", "ça"])
            old, new = r.randint(0, 29), r.randint(0, 29)
            return [
                f"UPDATE k_comp SET region = '{new_region}', code = {new} WHERE region = '{region}' AND code = {old}"
                f" AND NOT EXISTS (SELECT 1 FROM k_comp WHERE region = '{new_region}' AND code = {new})"
            ]
        if name == "k_uuid":
            new = r.randint(0, 59)
            return [
                f"UPDATE k_uuid SET id = md5('{new}')::uuid WHERE v % 7 = {r.randint(0, 6)} AND id = "
                f"(SELECT id FROM k_uuid ORDER BY id LIMIT 1) AND NOT EXISTS (SELECT 1 FROM k_uuid WHERE id = md5('{new}')::uuid)"
            ]
        old, new = r.randint(0, 99), r.randint(0, 130)
        return [f"UPDATE late SET id = {new} WHERE id = {old} AND NOT EXISTS (SELECT 1 FROM late WHERE id = {new})"]

    def random_dml(self) -> list[str]:
        weights = {"k_int": 5, "k_comp": 2, "k_uuid": 1, "full_t": 3, "dup_t": 3, "log_t": 2, "late": 2}
        name = self.rng.choices(list(weights), weights=list(weights.values()))[0]
        return self.dml(self.tables[name])

    # ---------------------------------------------------------------- DDL, truncate, large

    def ddl(self) -> list[str]:
        r = self.rng
        t = self.tables[r.choice(["k_int", "k_comp", "full_t", "dup_t", "log_t", "late", "k_uuid"])]
        added = [c for c in t.columns if c.startswith("x")]
        x = r.random()
        if added and x < 0.35:
            column = r.choice(added)
            del t.columns[column]
            t.dropped.add(column)
            return [f"ALTER TABLE {t.name} DROP COLUMN {column}"]
        widenable = [c for c in added if t.columns[c] == "int"]
        if widenable and x < 0.5:
            column = r.choice(widenable)
            t.columns[column] = "bigint"
            return [f"ALTER TABLE {t.name} ALTER COLUMN {column} TYPE bigint"]
        if x < 0.55 and "note" in t.columns and t.name == "k_comp":  # an original column dropped
            del t.columns["note"]
            t.dropped.add("note")
            return ["ALTER TABLE k_comp DROP COLUMN note"]
        kind = r.choice(list(ADDED_TYPES))
        column = f"x{self.next_column}_{kind}"
        self.next_column += 1
        t.columns[column] = kind
        return [f"ALTER TABLE {t.name} ADD COLUMN {column} {ADDED_TYPES[kind]}"]

    def truncate(self) -> list[str]:
        names = self.rng.sample(
            ["k_int", "k_comp", "k_uuid", "full_t", "dup_t", "log_t", "late"], k=self.rng.randint(1, 2)
        )
        if "k_int" in names:  # refill a few rows so later updates find something
            return [
                f"TRUNCATE {', '.join(names)}",
                "INSERT INTO k_int (id, name, body) SELECT g, 'refill', repeat('r', 3000) FROM generate_series(0, 60) g",
            ]
        return [f"TRUNCATE {', '.join(names)}"]

    def large(self, lo: int = 2000, hi: int = 5000) -> list[str]:
        """Thousands of changes: the server streams the transaction (logical_decoding_work_mem=64kB)."""
        r = self.rng
        self.heavy = True
        n = r.randint(1500, min(3000, hi - lo - 2))
        start = r.randint(lo, hi - n - 1)
        cols = ["id", "name", "n", "body"] + [c for c in self.tables["k_int"].columns if c.startswith("x")]
        values = ["g", "'bulk' || g", f"g * {r.randint(1, 9)}", r.choice(["NULL", "repeat(md5(g::text), 80)", "'b'"])]
        values += ["NULL"] * (len(cols) - 4)
        statements = [
            f"INSERT INTO k_int ({', '.join(cols)}) SELECT {', '.join(values)} FROM generate_series({start}, {start + n}) g"
            f" ON CONFLICT (id) DO UPDATE SET n = EXCLUDED.n, name = 'again'"
        ]
        if r.random() < 0.5:
            statements.append(
                f"UPDATE k_int SET amt = {value(r, 'numeric', False)} WHERE id BETWEEN {start} AND {start + n} AND id % 3 = 0"
            )
        if r.random() < 0.5:
            statements.append(f"DELETE FROM k_int WHERE id BETWEEN {start} AND {start + n} AND id % 4 = 1")
        if r.random() < 0.3:
            statements.append("INSERT INTO log_t (kind, n) SELECT 'bulk', g FROM generate_series(1, 1500) g")
        return statements

    # ---------------------------------------------------------------- transactions

    def body(self, n: int, allow_ddl: bool) -> list[str]:
        statements: list[str] = []
        for _ in range(n):
            x = self.rng.random()
            if allow_ddl and x < 0.06:
                statements += self.ddl()
            elif allow_ddl and x < 0.07:
                statements += self.truncate()
            else:
                statements += self.random_dml()
        return statements

    def transaction(self) -> None:
        r = self.rng
        x = r.random()
        allow_ddl = not self.busy
        if x < 0.45:
            self.sql(self.body(1, allow_ddl=False), note="autocommit")
        elif x < 0.62:
            self.sql(["BEGIN"] + self.body(r.randint(2, 6), allow_ddl) + ["COMMIT"], note="commit")
        elif x < 0.70:
            saved = copy.deepcopy(self.tables)
            statements = ["BEGIN"] + self.body(r.randint(1, 5), allow_ddl) + ["ROLLBACK"]
            self.tables = saved
            self.sql(statements, note="rolled back")
        elif x < 0.80:
            statements = ["BEGIN"] + self.body(r.randint(0, 3), allow_ddl)
            for i in range(r.randint(1, 2)):
                saved = copy.deepcopy(self.tables)
                statements += [f"SAVEPOINT s{i}"] + self.body(r.randint(1, 4), allow_ddl)
                if r.random() < 0.65:
                    statements.append(f"ROLLBACK TO SAVEPOINT s{i}")
                    self.tables = saved
                else:
                    statements.append(f"RELEASE SAVEPOINT s{i}")
                statements += self.body(r.randint(0, 2), allow_ddl)
            self.sql(statements + ["COMMIT"], note="savepoints")
        elif x < 0.85:
            self.large_transaction(allow_ddl)
        elif x < 0.92:
            self.two_phase(allow_ddl)
        elif x < 0.985 and allow_ddl:
            self.sql(self.ddl(), note="ddl")
        elif allow_ddl:
            self.sql(self.truncate(), note="truncate")
        else:
            self.sql(self.body(1, allow_ddl=False), note="autocommit")

    def large_transaction(self, allow_ddl: bool) -> None:
        r = self.rng
        saved = copy.deepcopy(self.tables)
        statements = ["BEGIN"]
        if allow_ddl and r.random() < 0.3:
            statements += self.ddl()  # a Relation message inside a streamed transaction
        statements += self.large() + self.body(r.randint(0, 3), allow_ddl=False)
        if r.random() < 0.3:  # a savepoint rolled back inside the streamed transaction
            inner = copy.deepcopy(self.tables)
            statements += ["SAVEPOINT big"] + self.large() + ["ROLLBACK TO SAVEPOINT big"]
            self.tables = inner
        if r.random() < 0.35:
            self.tables = saved
            self.sql(statements + ["ROLLBACK"], note="large, aborted")
        else:
            self.sql(statements + ["COMMIT"], note="large, committed")

    def two_phase(self, allow_ddl: bool) -> None:
        r = self.rng
        gid = f"g{self.next_gid}"
        self.next_gid += 1
        saved = copy.deepcopy(self.tables)
        statements = ["BEGIN"] + self.body(r.randint(1, 4), allow_ddl) + [f"PREPARE TRANSACTION '{gid}'"]
        if r.random() < 0.3:
            self.tables = saved
            self.sql(statements + [f"ROLLBACK PREPARED '{gid}'"], note="two-phase, rolled back")
        else:
            self.sql(statements + [f"COMMIT PREPARED '{gid}'"], note="two-phase, committed")

    def open_across_run(self) -> None:
        """A transaction on conn 2 (maybe streamed) left open across a run, or a prepared one pending."""
        r = self.rng
        lo, hi = OPEN_RANGE
        if not self.open_txn and r.random() < 0.5:
            statements = ["BEGIN"]
            if r.random() < 0.5:
                statements += self.large(lo, hi)
            else:
                k = r.randint(lo, hi - 50)
                statements += [
                    f"INSERT INTO k_int (id, name, body) VALUES ({k}, 'open', {value(r, 'toast')})"
                    " ON CONFLICT (id) DO UPDATE SET name = 'open again'",
                    f"UPDATE k_int SET n = {r.randint(0, 99)} WHERE id BETWEEN {lo} AND {hi - 1}",
                    "INSERT INTO log_t (kind, n) VALUES ('open', 1)",
                ]
            self.open_txn = True
            self.sql(statements, conn=1, note="left open")
        elif self.pending_gid is None:
            lo, hi = PREPARED_RANGE
            gid = f"p{self.next_gid}"
            self.next_gid += 1
            k = r.randint(lo, hi - 50)
            statements = ["BEGIN"]
            statements += (
                self.large(lo, hi)
                if r.random() < 0.4
                else [
                    f"INSERT INTO k_int (id, name) VALUES ({k}, 'prepared') ON CONFLICT (id) DO UPDATE SET n = -1",
                    f"DELETE FROM k_int WHERE id BETWEEN {lo} AND {hi - 1} AND id % 5 = 0",
                ]
            )
            self.sql(statements + [f"PREPARE TRANSACTION '{gid}'"], conn=1, note="prepared, pending")
            self.pending_gid = gid

    def close_pending(self) -> None:
        r = self.rng
        self.heavy = True  # what it wrote (maybe thousands of changes) arrives in the next run
        if self.open_txn:
            self.sql([r.choice(["COMMIT", "COMMIT", "ROLLBACK"])], conn=1, note="close the open transaction")
            self.open_txn = False
        if self.pending_gid is not None:
            verb = r.choice(["COMMIT PREPARED", "COMMIT PREPARED", "ROLLBACK PREPARED"])
            self.sql([f"{verb} '{self.pending_gid}'"], note="resolve the pending prepared transaction")
            self.pending_gid = None

    # ---------------------------------------------------------------- the whole workload

    def generate(self) -> list[Step]:
        r = self.rng
        runs = max(4, self.ops // 40)
        run_at = set(r.sample(range(1, self.ops), k=min(runs, self.ops - 1)))
        publish_at, snapshot_at = int(self.ops * r.uniform(0.1, 0.35)), int(self.ops * r.uniform(0.4, 0.6))
        resnapshot_at = {int(self.ops * r.uniform(0.3, 0.9)) for _ in range(r.randint(1, 2))}
        for i in range(self.ops):
            if i in run_at:
                if not self.busy and r.random() < 0.25:
                    self.open_across_run()
                self.run()
                if self.busy and r.random() < 0.7:
                    self.close_pending()
                continue
            if self.busy and r.random() < 0.05:
                self.close_pending()
            late = self.tables["late"]
            if i >= publish_at and not late.published and not self.busy:
                late.published = True
                self.sql(["ALTER PUBLICATION pub ADD TABLE late"], note="publish a table mid-stream")
                if r.random() < 0.5:
                    self.run()  # runs while the table has no snapshot: skipped, must not hold the slot
                continue
            if i >= snapshot_at and late.published and not late.snapshotted and not self.busy:
                late.snapshotted = True
                late.dropped = set()
                self.steps.append(Step("snapshot", table="late", note="first snapshot of the late table"))
                continue
            if resnapshot_at and i >= min(resnapshot_at) and not self.busy:
                resnapshot_at.discard(min(resnapshot_at))
                t = self.tables[r.choice(["k_int", "k_comp", "full_t", "dup_t", "log_t", "k_uuid"])]
                t.dropped = set()  # the snapshot replaces the Delta table with today's columns
                self.steps.append(Step("snapshot", table=t.name, note="re-snapshot mid-stream"))
                continue
            self.transaction()
        self.close_pending()
        self.run()
        return self.steps


def generate(seed: int, ops: int) -> list[Step]:
    return Generator(seed, ops).generate()
