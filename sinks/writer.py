"""Inserting chunks and batch plans through a clickhouse-connect client (the same on chdb and a server)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from areal_metrics.sinks.batching import Plan, TopicPartition
from areal_metrics.sinks.rows import Located, build_columns, projections_for, table_for
from areal_metrics.sinks.schema import BATCH_PLANS

# Set explicitly: ClickHouse changed the defaults of async inserts and of
# insert deduplication across versions (and Cloud turns async_insert on).
BASE_INSERT_SETTINGS: dict[str, Any] = {
    "async_insert": 0,  # synchronous: when insert() returns, the rows are stored
    "insert_deduplicate": 1,  # honour insert_deduplication_token
    "deduplicate_blocks_in_dependent_materialized_views": 1,
    "max_insert_block_size": 1_048_576,  # one chunk (<= max_rows rows) stays one block: one token
    "min_insert_block_size_rows": 0,
    "min_insert_block_size_bytes": 0,
}


def insert_settings(token: str) -> dict[str, Any]:
    return {**BASE_INSERT_SETTINGS, "insert_deduplication_token": token}


def insert_rows(client: Any, database: str, rows: Sequence[Located], token: str) -> int:
    """Insert one chunk (all rows of one table) as one deduplicated block; returns the row count.

    The tables projected from those events (generations from evals) get their
    block too, with the same token: deduplication is per table, so a retried
    chunk is dropped from both, and a crash between the two inserts is healed
    by the retry (the first is dropped, the second lands).
    """
    if not rows:
        return 0
    table = table_for(rows[0].event)
    for target in (table, *projections_for(table)):
        names, columns = build_columns(target, rows)
        if not columns or not columns[0]:
            continue  # e.g. eval events without samples: no generations
        client.insert(
            target.name,
            columns,
            column_names=list(names),
            database=database,
            column_oriented=True,
            settings=insert_settings(token),
        )
    return len(rows)


def record_plans(client: Any, database: str, group: str, plans: Mapping[TopicPartition, Plan]) -> None:
    """Write the plans of the chunks about to be inserted (one insert for all)."""
    if not plans:
        return
    items = sorted(plans.items())
    client.insert(
        BATCH_PLANS,
        [
            [group] * len(items),
            [tp[0] for tp, _ in items],
            [tp[1] for tp, _ in items],
            [p.first for _, p in items],
            [p.last for _, p in items],
        ],
        column_names=["consumer_group", "topic", "partition", "first_offset", "last_offset"],
        database=database,
        column_oriented=True,
        settings={"async_insert": 0},
    )


def load_plans(client: Any, database: str, group: str) -> dict[TopicPartition, Plan]:
    """The last recorded plan of every partition the group wrote."""
    r = client.query(
        f"SELECT topic, partition, argMax(first_offset, planned_at), argMax(last_offset, planned_at) "
        f"FROM {database}.{BATCH_PLANS} WHERE consumer_group = {{g:String}} GROUP BY topic, partition",
        parameters={"g": group},
    )
    return {(t, int(p)): Plan(int(f), int(last)) for t, p, f, last in r.result_rows}
