"""Inserting chunks and batch plans through a clickhouse-connect client (the same on chdb and a server)."""

from __future__ import annotations

import uuid
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


def insert_missing(client: Any, database: str, rows: Sequence[Located], token: str) -> int:
    """Store the rows of a retried chunk that its tables do not hold; returns how many events
    had rows to restore.

    A chunk retried after a crash is inserted with its token first (`insert_rows`),
    which drops what was stored. But ClickHouse records a block's token before
    it makes the block's part visible, so a process killed between the two
    leaves the token without the rows, and every retry with that token is
    dropped too. This reads which log positions each table holds and inserts
    the rest under a token of their own (fresh per call, the same across this
    call's retries): checked first, so they are inserted once.

    A row a merge replaced by a later copy of its event (a re-sent event) is
    held. Any other row a later version replaced would be inserted again, which
    changes nothing `FINAL` reads: the later version still wins.
    """
    if not rows:
        return 0
    first, last = min(r.offset for r in rows), max(r.offset for r in rows)
    ids = sorted({r.event.event_id for r in rows})
    topic, partition = rows[0].topic, rows[0].partition
    table = table_for(rows[0].event)
    restored: set[int] = set()
    again = f"{token}:restored:{uuid.uuid4().hex}"
    for target in (table, *projections_for(table)):
        held: set[int] = set()
        last_copy: dict[str, int] = {}
        for offset, event_id in client.query(
                f"SELECT DISTINCT _offset, event_id FROM {database}.{target.name} "
                "WHERE _topic = {t:String} AND _partition = {p:UInt32} AND _offset >= {a:UInt64} "
                "AND (_offset <= {b:UInt64} OR event_id IN {ids:Array(String)})",
                parameters={"t": topic, "p": partition, "a": first, "b": last, "ids": ids}).result_rows:
            held.add(int(offset))
            last_copy[event_id] = max(int(offset), last_copy.get(event_id, -1))
        missing = [r for r in rows if r.offset not in held and last_copy.get(r.event.event_id, -1) < r.offset]
        names, columns = build_columns(target, missing) if missing else ((), [])
        if not columns or not columns[0]:
            continue  # all held, or nothing this table would take (evals without samples)
        client.insert(target.name, columns, column_names=list(names), database=database,
                      column_oriented=True, settings=insert_settings(again))
        restored.update(columns[list(names).index("_offset")])
    return len(restored)


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
