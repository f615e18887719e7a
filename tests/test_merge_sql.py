"""The MERGE statement a drain runs, as text (resources/delta/merge.py: ``merge_statement``), no server.

What the statement does on the engines is proven by the engine tests (test_delta_engine.py, test_incremental.py,
test_deletion_vectors.py, ...); these pin its text: the ON clause (key, bucket predicate, key lists), the DELETE, UPDATE and
INSERT clauses, the unchanged-TOAST CASEs and the old-key join, the delete-and-insert form of whole-row changes).
"""

from __future__ import annotations

import pyarrow as pa

from resources.delta.layout import BUCKET_COLUMN
from resources.delta.merge import (
    KEY_LIST_MOST_VALUES,
    merge_statement,
    OLD_KEY_PREFIX,
    OP_COLUMN,
    unchanged_flag_column,
)
from resources.delta.staging import staged_source_sql

PATH = "/lake/public/orders"
STAGED = "/lake/public/orders/_pgcdc_staging/merge_source"
TARGET = "delta.`/lake/public/orders`"


def source_sql(source: pa.Table) -> str:
    """The staged source as the statement reads it: the staged Parquet files, cast to the batch's types."""
    return f"({staged_source_sql(source.schema, STAGED)})"


def batch(**columns: list[object]) -> pa.Table:
    """A merge source with the given columns (``op`` becomes :data:`OP_COLUMN`)."""
    named = {OP_COLUMN if name == "op" else name: values for name, values in columns.items()}
    return pa.table(named)


def test_keyed_unbucketed() -> None:
    source = batch(id=[1, 2], name=["a", "b"], op=["U", "D"])
    assert merge_statement(PATH, STAGED, source, ["id"], delete_and_insert=False) == (
        f"MERGE INTO {TARGET} t USING {source_sql(source)} s ON t.`id` = s.`id` AND t.`id` IN (1, 2) "
        "WHEN MATCHED AND s._pgcdc_op = 'D' THEN DELETE "
        "WHEN MATCHED THEN UPDATE SET `name` = s.`name` "
        "WHEN NOT MATCHED AND s._pgcdc_op <> 'D' THEN INSERT (`id`, `name`) VALUES (s.`id`, s.`name`)"
    )


def test_bucket_predicate_names_the_batch_buckets_and_the_null_bucket() -> None:
    source = batch(
        id=[30, 10, 11, 99], name=["a", "b", "c", "d"], **{BUCKET_COLUMN: [3, 1, 1, None]}, op=["I", "U", "D", "U"]
    )
    statement = merge_statement(PATH, STAGED, source, ["id"], delete_and_insert=False)
    assert (
        f" ON t.`id` = s.`id` AND (t.`{BUCKET_COLUMN}` IN (1, 3) OR t.`{BUCKET_COLUMN}` IS NULL) AND t.`id` IN (10, 11, 30, 99) "
        "WHEN MATCHED"
    ) in statement
    assert f"UPDATE SET `name` = s.`name`, `{BUCKET_COLUMN}` = s.`{BUCKET_COLUMN}` " in statement
    assert f"INSERT (`id`, `name`, `{BUCKET_COLUMN}`) VALUES (s.`id`, s.`name`, s.`{BUCKET_COLUMN}`)" in statement


def test_bucket_predicate_of_a_batch_without_buckets_is_the_null_bucket() -> None:
    source = batch(id=[5], **{BUCKET_COLUMN: pa.nulls(1, pa.int64())}, op=["U"])
    statement = merge_statement(PATH, STAGED, source, ["id"], delete_and_insert=False)
    assert f" ON t.`id` = s.`id` AND (t.`{BUCKET_COLUMN}` IS NULL) AND t.`id` IN (5) WHEN MATCHED" in statement


def test_unpruned_bucketed_table_reads_every_bucket() -> None:
    """``prune_buckets=False`` (the key does not hold the layout's key): no partition predicate, the
    bucket column is still written with the row."""
    source = batch(id=[1], name=["a"], **{BUCKET_COLUMN: [0]}, op=["U"])
    statement = merge_statement(PATH, STAGED, source, ["id"], prune_buckets=False, delete_and_insert=False)
    assert " ON t.`id` = s.`id` AND t.`id` IN (1) WHEN MATCHED AND" in statement
    assert f"UPDATE SET `name` = s.`name`, `{BUCKET_COLUMN}` = s.`{BUCKET_COLUMN}` " in statement


def test_every_column_a_key_has_no_update_clause() -> None:
    """Rows matched on all their columns (a key covering the whole row): a match is deleted or left as it is."""
    source = batch(a=[1], b=["x"], op=["I"])
    assert merge_statement(PATH, STAGED, source, ["a", "b"]) == (
        f"MERGE INTO {TARGET} t USING {source_sql(source)} s ON t.`a` = s.`a` AND t.`b` = s.`b` AND t.`a` IN (1) "
        "WHEN MATCHED AND s._pgcdc_op = 'D' THEN DELETE  "
        "WHEN NOT MATCHED AND s._pgcdc_op <> 'D' THEN INSERT (`a`, `b`) VALUES (s.`a`, s.`b`)"
    )


def test_composite_key_and_quoted_names() -> None:
    source = batch(**{"tenant": [1], "odd`name": [2], "value": ["v"]}, op=["U"])
    statement = merge_statement(PATH, STAGED, source, ["tenant", "odd`name"], delete_and_insert=False)
    assert (
        " ON t.`tenant` = s.`tenant` AND t.`odd``name` = s.`odd``name` AND t.`tenant` IN (1) AND t.`odd``name` IN (2) WHEN MATCHED"
    ) in statement
    assert "UPDATE SET `value` = s.`value` WHEN NOT MATCHED" in statement
    assert "INSERT (`tenant`, `odd``name`, `value`) VALUES (s.`tenant`, s.`odd``name`, s.`value`)" in statement


def test_path_with_a_backtick_is_quoted() -> None:
    source = batch(id=[1], op=["D"])
    statement = merge_statement("/lake/we`ird", "/lake/we`ird/_pgcdc_staging/merge_source", source, ["id"])
    assert statement.startswith(
        f"MERGE INTO delta.`/lake/we``ird` t USING ({staged_source_sql(source.schema, '/lake/we`ird/_pgcdc_staging/merge_source')}) s ON"
    )


def test_unchanged_toast_keeps_the_target_value() -> None:
    source = batch(id=[1], doc=[None], note=["n"], **{unchanged_flag_column("doc"): [True]}, op=["U"])
    statement = merge_statement(PATH, STAGED, source, ["id"])
    assert (
        "WHEN MATCHED THEN UPDATE SET `doc` = CASE WHEN NOT s.`_pgcdc_unchanged_doc` THEN s.`doc` ELSE t.`doc` END, "
        "`note` = s.`note` WHEN NOT MATCHED"
    ) in statement
    # without rows under old keys, an inserted row takes the source's values
    assert "INSERT (`id`, `doc`, `note`) VALUES (s.`id`, s.`doc`, s.`note`)" in statement
    assert f"USING {source_sql(source)} s ON" in statement


def test_moved_key_with_unchanged_toast_reads_the_old_row() -> None:
    source = batch(
        id=[2],
        doc=[None],
        **{BUCKET_COLUMN: [0], unchanged_flag_column("doc"): [True], OLD_KEY_PREFIX + "id": [1],
           OLD_KEY_PREFIX + BUCKET_COLUMN: [7]},
        op=["U"],
    )  # fmt: skip
    statement = merge_statement(PATH, STAGED, source, ["id"])
    old_rows = f"(SELECT * FROM {TARGET} WHERE (`{BUCKET_COLUMN}` IN (7) OR `{BUCKET_COLUMN}` IS NULL))"
    assert (
        f"USING (SELECT s.*, o.`doc` AS `_pgcdc_carried_doc`, o.`id` IS NOT NULL AS _pgcdc_old_row_found "
        f"FROM {source_sql(source)} s LEFT JOIN {old_rows} o ON o.`id` = s.`_pgcdc_oldkey_id`) s "
        f"ON t.`id` = s.`id` AND (t.`{BUCKET_COLUMN}` IN (0) OR t.`{BUCKET_COLUMN}` IS NULL) AND t.`id` IN (2) "
    ) in statement
    assert (
        "UPDATE SET `doc` = CASE WHEN NOT s.`_pgcdc_unchanged_doc` THEN s.`doc` "
        "WHEN s.`_pgcdc_oldkey_id` IS NOT NULL AND s._pgcdc_old_row_found THEN s.`_pgcdc_carried_doc` "
        f"ELSE t.`doc` END, `{BUCKET_COLUMN}` = s.`{BUCKET_COLUMN}` "
    ) in statement
    assert (
        f"INSERT (`id`, `doc`, `{BUCKET_COLUMN}`) VALUES (s.`id`, "
        "CASE WHEN s.`_pgcdc_unchanged_doc` THEN s.`_pgcdc_carried_doc` ELSE s.`doc` END, "
        f"s.`{BUCKET_COLUMN}`)"
    ) in statement


def test_moved_key_unpruned_reads_the_whole_table_for_old_rows() -> None:
    source = batch(id=[2], doc=[None], **{unchanged_flag_column("doc"): [True], OLD_KEY_PREFIX + "id": [1]}, op=["U"])
    statement = merge_statement(PATH, STAGED, source, ["id"])
    assert (
        f"FROM {source_sql(source)} s LEFT JOIN {TARGET} o ON o.`id` = s.`_pgcdc_oldkey_id`) s ON t.`id` = s.`id` AND t.`id` IN (2) WHEN"
        in statement
    )


def test_old_keys_without_kept_values_need_no_join() -> None:
    """Old-key columns matter only for kept (unchanged-TOAST) values: without flags the source is used as staged."""
    source = batch(id=[2], doc=["d"], **{OLD_KEY_PREFIX + "id": [1]}, op=["U"])
    statement = merge_statement(PATH, STAGED, source, ["id"], delete_and_insert=False)
    assert f"USING {source_sql(source)} s ON t.`id` = s.`id` AND t.`id` IN (2) WHEN" in statement
    assert "UPDATE SET `doc` = s.`doc` WHEN NOT MATCHED" in statement
    assert "INSERT (`id`, `doc`) VALUES (s.`id`, s.`doc`)" in statement


def test_key_list_holds_the_distinct_integer_keys_without_nulls() -> None:
    source = batch(id=pa.array([7, None, 3, 7], pa.int32()), op=["U", "D", "I", "D"])
    assert " ON t.`id` = s.`id` AND t.`id` IN (3, 7) WHEN MATCHED" in merge_statement(PATH, STAGED, source, ["id"])


def test_integer_keys_are_listed_up_to_the_limit_then_bounded_by_their_range() -> None:
    """Integer keys are listed up to :data:`KEY_LIST_MOST_VALUES` distinct values a column; above it,
    the target is bounded by the source keys' lowest and highest value (nulls left out); other
    types get neither."""
    text_key = batch(code=["a'b", "c"], op=["U", "U"])
    assert " ON t.`code` = s.`code` WHEN MATCHED" in merge_statement(PATH, STAGED, text_key, ["code"])
    most = batch(id=list(range(KEY_LIST_MOST_VALUES)), op=["U"] * KEY_LIST_MOST_VALUES)
    assert "t.`id` IN (0, 1, 2, " in merge_statement(PATH, STAGED, most, ["id"])
    many = batch(
        id=pa.array([*range(-3, KEY_LIST_MOST_VALUES), None], pa.int64()), op=["U"] * (KEY_LIST_MOST_VALUES + 4)
    )
    assert f" ON t.`id` = s.`id` AND t.`id` BETWEEN -3 AND {KEY_LIST_MOST_VALUES - 1} WHEN MATCHED" in merge_statement(
        PATH, STAGED, many, ["id"]
    )
    only_nulls = batch(id=pa.nulls(2, pa.int64()), op=["D", "D"])
    assert " ON t.`id` = s.`id` WHEN MATCHED" in merge_statement(PATH, STAGED, only_nulls, ["id"])
    composite = batch(
        tenant=[1] * (KEY_LIST_MOST_VALUES + 1),
        id=list(range(KEY_LIST_MOST_VALUES + 1)),
        op=["U"] * (KEY_LIST_MOST_VALUES + 1),
    )
    assert (
        " ON t.`tenant` = s.`tenant` AND t.`id` = s.`id` AND t.`tenant` IN (1)"
        f" AND t.`id` BETWEEN 0 AND {KEY_LIST_MOST_VALUES} WHEN MATCHED"
    ) in merge_statement(PATH, STAGED, composite, ["tenant", "id"])


def doubled(source: pa.Table) -> str:
    """The delete-and-insert MERGE's source: every change as a delete row, and all but deletes as an insert row."""
    return (
        f"(SELECT *, true AS _pgcdc_delete_row FROM {source_sql(source)} UNION ALL "
        f"SELECT *, false AS _pgcdc_delete_row FROM {source_sql(source)} WHERE _pgcdc_op <> 'D')"
    )


def test_whole_row_changes_delete_and_insert() -> None:
    """Changes that replace whole rows (the default): each change's delete row matches its key and deletes,
    its insert row (none for a delete) inserts the new image."""
    source = batch(id=[1, 2, 3], name=["a", None, "c"], **{BUCKET_COLUMN: [0, 0, 4]}, op=["U", "D", "I"])
    assert merge_statement(PATH, STAGED, source, ["id"]) == (
        f"MERGE INTO {TARGET} t USING {doubled(source)} s ON t.`id` = s.`id` AND s._pgcdc_delete_row "
        f"AND (t.`{BUCKET_COLUMN}` IN (0, 4) OR t.`{BUCKET_COLUMN}` IS NULL) AND t.`id` IN (1, 2, 3) "
        "WHEN MATCHED THEN DELETE "
        "WHEN NOT MATCHED AND NOT s._pgcdc_delete_row AND s._pgcdc_op <> 'D' "
        f"THEN INSERT (`id`, `name`, `{BUCKET_COLUMN}`) VALUES (s.`id`, s.`name`, s.`{BUCKET_COLUMN}`)"
    )


def test_delete_and_insert_unpruned_composite_and_with_old_keys() -> None:
    """Old-key columns without kept values are not the table's: staged along, never inserted."""
    source = batch(
        tenant=[9], id=[2], doc=["d"], **{BUCKET_COLUMN: [0], OLD_KEY_PREFIX + "id": [1], OLD_KEY_PREFIX + "tenant": [9]},
        op=["U"],
    )  # fmt: skip
    assert merge_statement(PATH, STAGED, source, ["tenant", "id"], prune_buckets=False) == (
        f"MERGE INTO {TARGET} t USING {doubled(source)} s ON t.`tenant` = s.`tenant` AND t.`id` = s.`id` AND s._pgcdc_delete_row "
        "AND t.`tenant` IN (9) AND t.`id` IN (2) "
        "WHEN MATCHED THEN DELETE "
        "WHEN NOT MATCHED AND NOT s._pgcdc_delete_row AND s._pgcdc_op <> 'D' "
        f"THEN INSERT (`tenant`, `id`, `doc`, `{BUCKET_COLUMN}`) VALUES (s.`tenant`, s.`id`, s.`doc`, s.`{BUCKET_COLUMN}`)"
    )


def test_kept_values_or_key_only_rows_keep_the_update_form() -> None:
    """An update keeping a target value must read it; a row of key columns only has nothing to replace."""
    kept = batch(id=[1], doc=[None], **{unchanged_flag_column("doc"): [True]}, op=["U"])
    assert (
        f"USING {source_sql(kept)} s ON t.`id` = s.`id` AND t.`id` IN (1) WHEN MATCHED AND s._pgcdc_op = 'D' THEN DELETE "
        in (merge_statement(PATH, STAGED, kept, ["id"]))
    )
    key_only = batch(a=[1], b=["x"], op=["I"])
    assert "_pgcdc_delete_row" not in merge_statement(PATH, STAGED, key_only, ["a", "b"])
