"""The harness itself: both servers are real, logical, and isolated per test."""

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
