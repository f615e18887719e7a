"""The configuration contract: key names, defaults, and one-line errors that name the key."""

from pathlib import Path

import pytest

from resources.config import load_config, parse_config
from resources.config.columns import as_text_fix, ColumnChoice
from resources.engines.kept_spark import ANSWER_TIMEOUT_ENV, answer_timeout_s, attach, SERVERS_DIR_ENV
from resources.errors import ConfigurationError, mask_dsn
from resources.names import TableName

MINIMAL = {"postgres": {"dsn": "postgresql://app:s3cret@db.internal:5433/shop"}, "publication": "pgcdc"}


def test_defaults_match_the_documented_file() -> None:
    config = parse_config(MINIMAL)
    assert config.slot == "pgcdc_slot"
    assert config.create_publication is False
    assert config.tables == []
    assert config.delta.root == "./lake"
    assert config.spark.remote is None and config.spark.config == {} and config.spark.keep_alive_s == 600
    assert config.snapshot.parallel_tables == 2
    assert config.schedule.cron == "*/5 * * * *"
    assert config.sensors.lag_bytes == 64 * 1024 * 1024


def test_table_paths_live_under_the_root(tmp_path: Path) -> None:
    config = parse_config({**MINIMAL, "delta": {"root": str(tmp_path)}})
    assert config.table_path("public", "orders") == str(tmp_path / "public" / "orders")


def test_history_is_per_table_with_a_default(tmp_path: Path) -> None:
    config = parse_config(
        {**MINIMAL, "delta": {"root": str(tmp_path)}, "history": {"tables": {'public."Orders"': "changelog"}}}
    )
    assert config.history_path("public", "Orders") == str(tmp_path / "public" / "Orders__changes")
    assert config.history_path("public", "orders") is None  # the default: none
    everything = parse_config({**MINIMAL, "history": {"default": "changelog", "tables": {"public.audit": "none"}}})
    assert everything.history_path("public", "audit") is None and everything.history_path("s", "t") is not None


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"slott": "x"}, "unknown key 'slott'"),
        ({"delta": {"root": "/x", "rooot": "/y"}}, "unknown key 'delta.rooot'"),
        ({"snapshot": {"parallel_tables": 0}}, "'snapshot.parallel_tables'"),
        ({"tables": ["orders"]}, "'tables': Value error, 'orders' is not schema.table"),
        ({"slot": "Bad-Name"}, "'slot'"),
        ({"spark": {"remote": "http://spark:15002"}}, "'spark.remote'"),
        ({"spark": {"keep_alive_s": -1}}, "'spark.keep_alive_s': Value error, got -1: write a whole number of seconds"),
        ({"spark": {"keep_alive_s": "10m"}}, "'spark.keep_alive_s': Value error, got '10m': write a whole number"),
        ({"spark": {"keep_alive_s": 1.5}}, "'spark.keep_alive_s': Value error, got 1.5: write a whole number"),
        ({"spark": {"keep_alive_s": True}}, "'spark.keep_alive_s': Value error, got True: write a whole number"),
        ({"publication": ""}, "'publication'"),
        ({"history": {"default": "scd9"}}, "'history.default'"),
        (
            {"history": {"tables": {"orders": "changelog"}}},
            "'history.tables': Value error, 'orders' is not schema.table",
        ),
        ({"history": {"tables": {"public.orders": "log"}}}, "'history.tables.public.orders'"),
        ({"columns": {"public.orders": "text"}}, "'columns': Value error, 'public.orders' is not schema.table.column"),
        ({"columns": {'public."Order Items.due': "text"}}, "has an unterminated quote"),
        ({"columns": {"public.orders.due": "txt"}}, "public.orders.due: got 'txt': write text, exclude or {rename: "),
        ({"columns": {"public.orders.due": True}}, "public.orders.due: got True: write text, exclude or {rename: "),
        ({"columns": {"public.orders.due": {"renam": "d"}}}, "unknown key 'columns.public.orders.due.renam'"),
        ({"columns": {"public.orders.due": {"rename": ""}}}, "'columns.public.orders.due.rename'"),
        ({"columns": {"public.orders.due": {"exclude": True, "text": True}}}, "exclude takes no text or rename"),
        ({"columns": {"public.orders.due": {"rename": "_pgcdc_lsn"}}}, "are pgcdc's own columns"),
        ({"columns": {"public.orders.due": "text", 'public.Orders."due"': "exclude"}}, "name the same column"),
    ],
)
def test_each_bad_key_is_named(override: dict, expected: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        parse_config({**MINIMAL, **override})
    assert expected in str(raised.value)
    assert "\n" not in str(raised.value)


def test_columns_are_read_as_postgresql_reads_names(tmp_path: Path) -> None:
    path = tmp_path / "pgcdc.yaml"
    path.write_text(
        "postgres:\n  dsn: postgresql://u@h/db\npublication: pub\ncolumns:\n"
        "  public.orders.Due: text\n"
        '  \'public."Order Items"."Due.Date"\': text\n'
        '  \'"My Schema".t."Say ""Hi"""\': {rename: say_hi}\n'
        '  public.t."Duration": {rename: duration_2, text: true}\n'
        "  public.t.secret: exclude\n"
    )
    overrides = load_config(path).column_overrides
    assert overrides.for_table(TableName("public", "orders")) == {"due": ColumnChoice(as_text=True)}
    assert overrides.for_table(TableName("public", "Order Items")) == {"Due.Date": ColumnChoice(as_text=True)}
    assert overrides.for_table(TableName("My Schema", "t")) == {'Say "Hi"': ColumnChoice(rename="say_hi")}
    assert overrides.for_table(TableName("public", "t")) == {
        "Duration": ColumnChoice(as_text=True, rename="duration_2"),
        "secret": ColumnChoice(exclude=True),
    }
    assert overrides.for_table(TableName("public", "other")) == {}
    assert parse_config(MINIMAL).column_overrides.for_table(TableName("public", "orders")) == {}


def test_the_key_a_fix_names_is_one_the_configuration_reads() -> None:
    for schema, table, column, printed in [
        ("public", "t", "d", '"public.t.d"'),
        ("public", "Order Items", "Due.Date", """'public."Order Items"."Due.Date"'"""),
        ("s", "t", 'Say "Hi"', '\'s.t."Say ""Hi"""\''),
    ]:
        fix = as_text_fix(TableName(schema, table), column)
        assert fix.startswith(f"set columns: {{{printed}: text}} in the pipeline's configuration, then re-snapshot")
        config = parse_config({**MINIMAL, "columns": {printed[1:-1]: "text"}})
        assert config.column_overrides.for_table(TableName(schema, table)) == {column: ColumnChoice(as_text=True)}


def test_missing_required_keys_are_named() -> None:
    with pytest.raises(ConfigurationError, match="'postgres' is required"):
        parse_config({"publication": "p"})


def test_passwords_never_show(tmp_path: Path) -> None:
    config = parse_config(MINIMAL)
    assert "s3cret" not in repr(config) and "s3cret" not in str(config.postgres)
    assert mask_dsn(config.postgres.dsn) == "app@db.internal:5433/shop"
    with pytest.raises(ConfigurationError) as raised:
        parse_config({**MINIMAL, "postgres": {"dsn": "postgresql://app:s3cret@h/db", "port": 5}})
    assert "s3cret" not in str(raised.value)


def test_load_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "pgcdc.yaml"
    path.write_text("postgres:\n  dsn: postgresql://u@h/db\npublication: pub\ntables: [public.a, public.b]\n")
    monkeypatch.setenv("PGCDC_CONFIG", str(path))
    assert load_config().tables == ["public.a", "public.b"]
    monkeypatch.delenv("PGCDC_CONFIG")
    with pytest.raises(ConfigurationError, match="PGCDC_CONFIG is not set"):
        load_config()
    path.write_text("postgres: [unclosed\n")
    with pytest.raises(ConfigurationError, match="not valid YAML"):
        load_config(path)


def test_a_table_key_with_dots_is_read_back_by_its_path(tmp_path: Path) -> None:
    """``"a.b".c`` and ``a."b.c"`` share the key ``a.b.c`` in pgcdc's state and quarantine records; their
    Delta paths tell them apart."""
    config = parse_config(
        {"postgres": {"dsn": "host=h"}, "publication": "p", "slot": "s", "delta": {"root": str(tmp_path)}}
    )
    for table in (TableName("a.b", "c"), TableName("a", "b.c"), TableName("sch", 'é$.say "hi"')):
        assert config.table_at(str(table), config.table_path(table.schema, table.name)) == table


def test_a_bad_kept_jvm_answer_timeout_is_one_line_before_any_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``$PGCDC_SPARK_ANSWER_TIMEOUT`` (how long a kept JVM may take to answer before a run replaces it):
    a value that is not seconds above 0 fails the run in one line before it probes, stops or starts a server."""
    monkeypatch.setenv(SERVERS_DIR_ENV, str(tmp_path / "servers"))
    for value in ("soon", "0", "-5", "nan"):
        monkeypatch.setenv(ANSWER_TIMEOUT_ENV, value)
        with pytest.raises(ConfigurationError) as raised:
            attach("local[2]", {}, {}, keep_alive_s=600)
        assert str(raised.value) == (
            f"$PGCDC_SPARK_ANSWER_TIMEOUT is {value!r}, not a number of seconds above 0: set it to the seconds a"
            " kept Spark JVM may take to answer (say 60) or unset it (10 s)"
        )
    assert not (tmp_path / "servers").exists()
    monkeypatch.setenv(ANSWER_TIMEOUT_ENV, "90")
    assert answer_timeout_s() == 90
    monkeypatch.delenv(ANSWER_TIMEOUT_ENV)
    assert answer_timeout_s() == 10
