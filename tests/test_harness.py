"""The harness itself: both servers are real, logical, and isolated per test; the verifier's diff reads."""

from resources.testing.verify import _diff
from tests.support.postgres import PgDatabase


def test_server_is_logical_and_of_the_expected_version(pg: PgDatabase) -> None:
    ((version_num, wal_level, prepared),) = pg.execute(
        "SELECT current_setting('server_version_num')::int, current_setting('wal_level'),"
        " current_setting('max_prepared_transactions')::int"
    )
    assert version_num // 10000 == pg.major
    assert wal_level == "logical"
    assert prepared > 0


def test_each_test_gets_an_empty_database(pg: PgDatabase) -> None:
    assert pg.execute("SELECT count(*) FROM pg_class WHERE relnamespace = 'public'::regnamespace") == [(0,)]
    assert pg.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()") == [(0,)]


def test_a_diff_of_wide_rows_cuts_each_long_value_to_its_start_and_length() -> None:
    """The crash tests' rows carry values of 1,800 characters: a diff shows each row on a line a reader can scan."""
    wide = "b" * 1800
    keyless = _diff("public.ledger", ["entry", "note"], (), [(1, wide)], [(1, wide), (1, wide)])
    assert keyless.splitlines()[1] == f"  only in Delta:      (1, {repr(wide)[:60]}...(1802 chars))"
    keyed = _diff("public.acct", ["id", "note"], ("id",), [(7, "short")], [(7, wide)])
    assert keyed.splitlines()[1:] == [
        "  key (7,): PostgreSQL (7, 'short')",
        f"            Delta      [(7, {repr(wide)[:60]}...(1802 chars))]",
    ]
