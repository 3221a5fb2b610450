"""Inserting chunks and batch plans through a clickhouse-connect client (the same on chdb and a server)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from areal_metrics.sinks import rank_aggregates, step_means
from areal_metrics.sinks.batching import Plan, TopicPartition, dedup_token
from areal_metrics.sinks.rows import Located, build_columns, projections_for, table_for
from areal_metrics.sinks.schema import BATCH_PLANS, Table

# Set explicitly: ClickHouse changed the defaults of async inserts and of
# insert deduplication across versions (and Cloud turns async_insert on).
BASE_INSERT_SETTINGS: dict[str, Any] = {
    "async_insert": 0,  # synchronous: when insert() returns, the rows are stored
    "insert_deduplicate": 1,  # honour insert_deduplication_token
    # and in the tables a materialized view fills (step_aggregates): without it a block the
    # steps table drops as a duplicate is still added to the per-step sums
    "deduplicate_blocks_in_dependent_materialized_views": 1,
    "max_insert_block_size": 1_048_576,  # the server does not cut a block (max_rows rows a partition) further
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


# Tables whose materialized views fill aggregates, and for each view's tables: which of a table's held rows
# they have counted (a row the table holds may still be missing there: see insert_missing's `views_may_lack`)
_COUNTED_BY_VIEWS = {"steps": (step_means.counted, rank_aggregates.counted)}


def insert_missing(client: Any, database: str, rows: Sequence[Located], token: str,
                   views_may_lack: bool = False) -> int:
    """Store the rows of a retried chunk that its tables do not hold, as one block per table with
    `token`; returns how many events had rows to restore.

    A chunk retried after a crash is inserted with its token first (`insert_rows`),
    which drops what was stored. But ClickHouse records a block's token before
    it makes the block's part visible, so a process killed between the two
    leaves the token without the rows, and every retry with that token is
    dropped too. A row counts as held when its table has a row of the same
    sorting key at the same or a later version: itself, or the later version a
    merge kept in its place (a re-sent event, a step logged again, a resumed
    attempt's row). The caller gives a token of its own, the same across its
    retries, so a retried restore deduplicates too.

    `views_may_lack`: the rows went in before in a block whose token no insert can give again (a block
    retried in part), so a kill between that block's part and its materialized views' parts may have
    left a row in its table and not in the aggregates, where no count rule can see it missing (the
    aggregates detect a row counted twice, not one never counted). A held row that some aggregate has
    not counted is then inserted again: its table keeps one copy (same key and version), an aggregate
    that lacked it counts it once, one that had it counts it twice and reads that step from the raw rows.
    """
    if not rows:
        return 0
    table = table_for(rows[0].event)
    runs = sorted({r.event.run_id for r in rows})
    restored: set[tuple[int, int]] = set()
    for target in (table, *projections_for(table)):
        names, columns = build_columns(target, rows)
        if not columns or not columns[0]:
            continue  # nothing this table takes (evals without samples)
        column = dict(zip(names, columns))
        keys, versions = _keys(target, column), _versions(target, column)
        held, several = _held_versions(client, database, target, runs, set(keys))
        # a row is its log position: a block holds several partitions, whose offsets overlap
        missing_at = {(partition, offset) for partition, offset, key, version
                      in zip(column["_partition"], column["_offset"], keys, versions) if held.get(key, -1) < version}
        counters = _COUNTED_BY_VIEWS.get(target.name, ()) if views_may_lack else ()
        if counters:
            at_version = {(partition, offset): ((run, int(attempt), int(step), int(rank)), key)
                          for partition, offset, key, version, run, attempt, step, rank
                          in zip(column["_partition"], column["_offset"], keys, versions, column["run_id"],
                                 column["attempt"], column["step"], column["rank"]) if held.get(key, -1) == version}
            counted = {row for row, _ in at_version.values()}
            for count in counters:
                counted &= count(client, database, counted)
            # a bit set says the rank's step was counted, not which version: a key stored more than once (a step
            # logged again) may have had another version counted, so its row goes in again (the aggregate then
            # counts the rank twice and reads that step from the raw rows). Once a merge has kept one version,
            # this cannot be seen: a limit (docs/CLICKHOUSE.md).
            missing_at |= {at for at, (row, key) in at_version.items() if row not in counted or key in several}
        if not missing_at:
            continue
        names, columns = build_columns(target, [r for r in rows if (r.partition, r.offset) in missing_at])
        client.insert(target.name, columns, column_names=list(names), database=database,
                      column_oriented=True, settings=insert_settings(token))
        restored |= missing_at
    return len(restored)


def _keys(table: Table, column: Mapping[str, list[Any]]) -> list[tuple[str, ...]]:
    """Each built row's sorting key, as text (every key column is a string or an integer)."""
    return list(zip(*([str(v) for v in column[name]] for name in table.order_by)))


def _versions(table: Table, column: Mapping[str, list[Any]]) -> list[int]:
    """Each built row's ReplacingMergeTree version, as the table computes it (schema.VERSION)."""
    if table.version == "_offset":
        return list(column["_offset"])
    return [(attempt << 43) + offset for attempt, offset in zip(column["attempt"], column["_offset"])]


def _held_versions(client: Any, database: str, table: Table, runs: list[str],
                   keys: set[tuple[str, ...]]) -> tuple[dict[tuple[str, ...], int], set[tuple[str, ...]]]:
    """The newest version the table holds of each of these sorting keys (absent: none), and the keys it holds
    in more than one version (not merged into one yet)."""
    key = ", ".join(f"toString({name})" for name in table.order_by)
    result = client.query(
        f"SELECT [{key}], max({table.version}), uniqExact({table.version}) > 1 FROM {database}.{table.name} "
        f"WHERE run_id IN {{runs:Array(String)}} AND has({{keys:Array(Array(String))}}, [{key}]) GROUP BY 1",
        parameters={"runs": runs, "keys": [list(k) for k in keys]})
    return ({tuple(k): int(v) for k, v, _ in result.result_rows},
            {tuple(k) for k, _, several in result.result_rows if several})


def record_plans(client: Any, database: str, group: str, plans: Mapping[TopicPartition, Plan]) -> None:
    """Write the plans of the chunks about to be inserted (one insert for all), each with its `group`: the
    token of the block its chunk goes in."""
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
            [p.group for _, p in items],
        ],
        column_names=["consumer_group", "topic", "partition", "first_offset", "last_offset", "block"],
        database=database,
        column_oriented=True,
        settings={"async_insert": 0},
    )


def load_plans(client: Any, database: str, group: str) -> dict[TopicPartition, Plan]:
    """The last recorded plan of every partition the group wrote, its `group` the token of the block its chunk
    went in (a plan recorded before schema version 15: its chunk's own, as it went in alone)."""
    r = client.query(
        f"SELECT topic, partition, argMax(first_offset, planned_at), argMax(last_offset, planned_at), "
        f"argMax(block, planned_at) "
        f"FROM {database}.{BATCH_PLANS} WHERE consumer_group = {{g:String}} GROUP BY topic, partition",
        parameters={"g": group},
    )
    return {(t, int(p)): Plan(int(f), int(last), block or dedup_token(t, int(p), int(f), int(last)))
            for t, p, f, last, block in r.result_rows}
