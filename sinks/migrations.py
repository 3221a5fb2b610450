"""Schema migrations: numbered, idempotent, recorded in `schema_migrations`.

`apply_schema(client, options)` creates or upgrades the store to the tables of
`areal_metrics.sinks.schema`; a key change (ClickHouse cannot ALTER a sorting or partition
key) is a copy-and-swap (`Rekey`). `schema_statements` lists every statement it
may run, for review. Drop and recreate serve `replay`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from areal_metrics.sinks.schema import (
    BATCH_PLANS,
    MIGRATIONS_TABLE,
    PARTITION_BY,
    TABLES,
    TABLES_BY_NAME,
    CommandClient,
    SchemaOptions,
    command_status_view_sql,
    create_table_sql,
    create_view_sql,
    drop_table_sql,
    plans_sql,
)
from areal_metrics.sinks import rank_aggregates
from areal_metrics.sinks.step_means import AGGREGATES, backfill_sql, rank_words_statements, step_means_view_sql
from areal_metrics.sinks.step_means import create_statements as step_means_statements
from areal_metrics.sinks.step_means import drop_statements as step_means_drops

log = logging.getLogger("areal.sink.schema")


def _migrations_sql(o: SchemaOptions) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {o.database}.{MIGRATIONS_TABLE}{o.on_cluster} (\n"
        f"    version UInt32, description String, applied_at DateTime64(3, 'UTC') DEFAULT now64(3, 'UTC')\n"
        f")\nENGINE = {o.engine(MIGRATIONS_TABLE)}\nORDER BY version"
    )


@dataclass(frozen=True, slots=True)
class Rekey:
    """Move a table to a new sorting or partition key (ClickHouse cannot ALTER them): copy into a new
    table, swap, drop.

    Idempotent by looking: a table that already has both keys is left alone (a
    copy left over by an interrupted run is dropped); an interrupted copy is
    started again from scratch. Rows keep every column, `_ingested_at` included.
    On a cluster the DDL runs ON CLUSTER and the copy (an INSERT, which has no
    ON CLUSTER) runs once: the tables are replicated, one shard.
    """

    table: str
    version: int  # the migration's: names the copy (and its Keeper path on a cluster) uniquely

    def temp(self) -> str:
        return f"{self.table}__v{self.version}"

    def statements(self, o: SchemaOptions) -> list[str]:
        t, db, oc = TABLES_BY_NAME[self.table], o.database, o.on_cluster
        cols = "<the columns both tables have>"
        return [
            f"DROP TABLE IF EXISTS {db}.{self.temp()}{oc} SYNC",
            create_table_sql(t, o, self.temp()),
            f"INSERT INTO {db}.{self.temp()} ({cols}) SELECT {cols} FROM {db}.{t.name}",
            f"EXCHANGE TABLES {db}.{t.name} AND {db}.{self.temp()}{oc}",
            f"DROP TABLE IF EXISTS {db}.{self.temp()}{oc} SYNC",
        ]

    def apply(self, client: Any, o: SchemaOptions) -> None:
        t, db = TABLES_BY_NAME[self.table], o.database
        where = f"database = '{db}' AND name = '{t.name}'"
        keys = str(client.command(f"SELECT concat(sorting_key, '|', partition_key) FROM system.tables WHERE {where}"))
        drop, create, insert, exchange, _ = self.statements(o)
        if "|" not in keys:  # no such table (yet): nothing to move, make it in its layout
            client.command(create_table_sql(t, o))
            return
        if _layout(*keys.partition("|")[::2]) == _layout(", ".join(t.order_by), PARTITION_BY):
            client.command(drop)
            return
        old = set(str(client.command(f"SELECT arrayStringConcat(groupArray(name), ',') FROM system.columns "
                                     f"WHERE {where.replace('name =', 'table =')}")).split(","))
        cols = ", ".join(f"`{c.name}`" for c in t.columns if c.name in old and c.name != "_version")
        client.command(drop)
        client.command(create)
        client.command(insert.replace("<the columns both tables have>", cols))
        client.command(exchange)
        client.command(drop)


def _layout(sorting_key: str, partition_key: str) -> tuple[str, str]:
    """A table's keys as system.tables spells them, spaces aside."""
    return "".join(str(sorting_key).split()), "".join(str(partition_key).split())


Statement = str | Rekey


def migrations(o: SchemaOptions) -> list[tuple[int, str, list[Statement]]]:
    """(version, description, idempotent statements), oldest first."""
    v1 = [create_table_sql(t, o) for t in TABLES] + [plans_sql(o)] + [create_view_sql(t, o) for t in TABLES]
    # v2 brings a store made by v1 to the columns above (on a new store v1 already made
    # them, and every statement here is then a no-op).
    v2 = [
        f"ALTER TABLE {o.database}.steps{o.on_cluster} MODIFY COLUMN epoch Float64",
        *_add_columns("steps", ("world_size", "attempt", "non_finite", "n_samples"), o),
        *_add_columns("evals", ("dataset_fingerprint", "metrics", "attempt"), o),
        create_table_sql(TABLES_BY_NAME["runs"], o),
        create_view_sql(TABLES_BY_NAME["runs"], o),
    ]
    # v3: steps and evals keyed by what they are about, versioned by (attempt, offset), so
    # a resumed attempt replaces the earlier one's rows; generations; v_runs folds run events.
    v3: list[Statement] = [
        Rekey("steps", 3),
        Rekey("evals", 3),
        create_table_sql(TABLES_BY_NAME["generations"], o),
        create_view_sql(TABLES_BY_NAME["generations"], o),
        create_view_sql(TABLES_BY_NAME["steps"], o),
        create_view_sql(TABLES_BY_NAME["evals"], o),
        create_view_sql(TABLES_BY_NAME["runs"], o),
    ]
    # v4: every table partitioned by run (FINAL per partition; a run's parts apart from the others'),
    # copied into the new layout; the views again (v_steps may leave out expired rows).
    v4: list[Statement] = [*(Rekey(t.name, 4) for t in TABLES), *(create_view_sql(t, o) for t in TABLES)]
    # v5: a run's display name (init(name=...)) beside its run_id
    v5: list[Statement] = [*_add_columns("runs", ("name",), o), create_view_sql(TABLES_BY_NAME["runs"], o)]
    # v6: the evaluation statistics: a sharded round's layout on evals, the
    # consensus's decided and undecided samples and its 95 % interval; the views again.
    v6: list[Statement] = [
        *_add_columns("evals", ("sample_ids", "shard_nodes"), o),
        *_add_columns("eval_consensus", ("n_samples", "n_undecided", "ci_low", "ci_high"), o),
        create_view_sql(TABLES_BY_NAME["evals"], o),
        create_view_sql(TABLES_BY_NAME["eval_consensus"], o),
    ]
    # v7 (5 is runs.name, on another branch): evaluation details: a sample's gold answer and error
    # type; the consensus's pass@K, maj@K, greedy_accuracy; the views again.
    v7: list[Statement] = [
        *_add_columns("generations", ("gold", "error_type"), o),
        *_add_columns("eval_consensus", ("metrics",), o),
        create_view_sql(TABLES_BY_NAME["generations"], o),
        create_view_sql(TABLES_BY_NAME["eval_consensus"], o),
    ]
    # v8: trainers' acknowledgements of commands (topic `acks`), and per command who applied it
    v8: list[Statement] = [create_table_sql(TABLES_BY_NAME["command_acks"], o),
                           create_view_sql(TABLES_BY_NAME["command_acks"], o), command_status_view_sql(o)]
    # v9: per-step aggregates kept at insert time (sinks/step_means.py): the table, the
    # materialized view that fills it from every insert into steps, the steps already
    # stored, and v_step_means. A row added twice (a backfill racing live inserts) is
    # recomputed from v_steps by the view, so the backfill needs no pause.
    v9: list[Statement] = [*step_means_statements(o)[:2], backfill_sql(o), step_means_statements(o)[2]]
    # v10: W&B's run notes (init(notes=...)) and run.summary (canonical JSON text), on runs and in v_runs.
    # Rows stored before have NULL in both; the run events on the topic hold them (`replay` fills them in).
    v10: list[Statement] = [*_add_columns("runs", ("notes", "summary"), o), create_view_sql(TABLES_BY_NAME["runs"], o)]
    # v11: per-rank aggregates kept at insert time (sinks/rank_aggregates.py), 64 steps to a row, for
    # the efficiency dashboard's per-rank panels: the table, its materialized view, the steps already
    # stored, v_rank_buckets and v_rank_buckets_of(runs). As in v9 a row added twice is recomputed
    # from v_steps by the view.
    r11 = rank_aggregates.create_statements(o)
    v11: list[Statement] = [*r11[:2], rank_aggregates.backfill_sql(o), *r11[2:]]
    # v12: v_step_means_of(runs), v_step_means for the given runs alone: the dashboards' run filter then
    # reaches the view's check for steps delivered twice, which reads every run's aggregates otherwise.
    v12: list[Statement] = [step_means_view_sql(o, of_runs=True)]
    # v13: step_aggregates.rank_words, the rank set as summed plain words beside its aggregate state, filled
    # for the rows already stored; both step-means views check for steps delivered twice on it (a plain read,
    # where deserializing every step's state took most of a per-step panel's time).
    v13: list[Statement] = [*rank_words_statements(o), step_means_view_sql(o), step_means_view_sql(o, of_runs=True)]
    # v14: the per-rank aggregates' coarse level (512 steps to a row, filled from the fine rows by a cascaded
    # materialized view) and v_rank_buckets_coarse_of(runs), which the efficiency board reads for long ranges.
    # The 64-step views again: their raw rows are picked by a set of buckets (not of each bucket's steps).
    v14: list[Statement] = [*rank_aggregates.coarse_migration_statements(o), rank_aggregates.view_sql(o),
                            rank_aggregates.view_sql(o, of_runs=True)]
    # v15: the block each batch plan's chunk went in (its insert_deduplication_token): a flush inserts a topic's
    # chunks as one block, which the retry after a crash must give again whole or not at all. Plans recorded
    # before have '' (their chunk went in alone, under its own token).
    v15: list[Statement] = [plans_sql(o), f"ALTER TABLE {o.database}.{BATCH_PLANS}{o.on_cluster} ADD COLUMN IF NOT "
                            "EXISTS block String DEFAULT ''"]
    return [
        (1, "one ReplacingMergeTree table per topic, FINAL views, batch plans", v1),
        (2, "client fields: fractional epoch, world_size, attempt, non_finite, n_samples; eval fingerprint and metrics; runs", v2),
        (3, "steps and evals keyed by run, step, rank (a later attempt replaces); generations; v_runs", v3),
        (4, "every table partitioned by run (cityHash64(run_id) % 16)", v4),
        (5, "runs.name: the display name of init(name=...)", v5),
        (6, "evaluation statistics: evals.sample_ids, shard_nodes; eval_consensus n_samples, n_undecided, ci_low, "
            "ci_high", v6),
        (7, "evaluation details: generations.gold, error_type; eval_consensus.metrics", v7),
        (8, "command_acks: what each trainer node did with each command; v_command_status", v8),
        (9, "per-step aggregates at insert time: step_aggregates, step_aggregates_mv, v_step_means", v9),
        (10, "runs.notes and runs.summary: W&B's init(notes=...) and run.summary; v_runs shows both", v10),
        (11, "per-rank aggregates at insert time: rank_aggregates, rank_aggregates_mv, v_rank_buckets, v_rank_buckets_of", v11),
        (12, "v_step_means_of(runs): the per-step means of the given runs, every read narrowed to them", v12),
        (13, "step_aggregates.rank_words: the rank set as summed words, read by the check for steps delivered twice", v13),
        (14, "per-rank aggregates of 512 steps: rank_aggregates_coarse, its materialized view, v_rank_buckets_coarse_of", v14),
        (15, "_sink_batches.block: the block (deduplication token) each planned chunk went in", v15),
    ]


def _add_columns(table: str, names: Sequence[str], o: SchemaOptions) -> list[str]:
    columns = {c.name: c for c in TABLES_BY_NAME[table].columns}
    return [f"ALTER TABLE {o.database}.{table}{o.on_cluster} ADD COLUMN IF NOT EXISTS {columns[n].ddl()}" for n in names]


def schema_statements(o: SchemaOptions = SchemaOptions()) -> list[str]:
    """Every statement `apply_schema` may run, in order (for review and for docs)."""
    out = [f"CREATE DATABASE IF NOT EXISTS {o.database}{o.on_cluster}", _migrations_sql(o)]
    for _, _, stmts in migrations(o):
        for stmt in stmts:
            if isinstance(stmt, Rekey):  # a new store makes the table in its layout; an older one copies
                out.extend([create_table_sql(TABLES_BY_NAME[stmt.table], o), *stmt.statements(o)])
            else:
                out.append(stmt)
    return [*out, _ttl_sql(o), create_view_sql(TABLES_BY_NAME["steps"], o),  # apply_ttl: when the TTL differs
            *(_merge_width_sql(o, t) for t in WIDE_MERGE_TABLES)]  # apply_merge_width: when the width differs


def applied_version(client: Any, o: SchemaOptions = SchemaOptions()) -> int:
    """The highest recorded migration, 0 when none (or no database yet)."""
    exists = client.command(
        f"SELECT count() FROM system.tables WHERE database = '{o.database}' AND name = '{MIGRATIONS_TABLE}'"
    )
    if not int(exists):
        return 0
    return int(client.command(f"SELECT max(version) FROM {o.database}.{MIGRATIONS_TABLE}") or 0)


def apply_schema(client: CommandClient, options: SchemaOptions = SchemaOptions()) -> int:
    """Create or upgrade the schema; safe to run any number of times. Returns the version now applied.

    Every statement is idempotent, and a migration is recorded only after all
    its statements succeeded, so an interrupted run is finished by the next.
    """
    o = options
    client.command(f"CREATE DATABASE IF NOT EXISTS {o.database}{o.on_cluster}")
    client.command(_migrations_sql(o))
    current = applied_version(client, o)
    for version, description, stmts in migrations(o):
        if version <= current:
            continue
        for stmt in stmts:
            if isinstance(stmt, Rekey):
                stmt.apply(client, o)
            else:
                client.command(stmt)
        escaped = description.replace("\\", "\\\\").replace("'", "\\'")
        client.command(f"INSERT INTO {o.database}.{MIGRATIONS_TABLE} (version, description) VALUES ({version}, '{escaped}')")
        current = version
    apply_ttl(client, o)
    apply_merge_width(client, o)
    return current


def apply_ttl(client: CommandClient, o: SchemaOptions) -> None:
    """Give raw steps the TTL the options ask for (or none), and `v_steps` the matching filter.

    Not a migration: the setting may change between two starts of the sink.
    ALTER only when the table's TTL differs (a changed TTL is applied to the
    stored parts too, ClickHouse's `materialize_ttl_after_modify`).
    """
    steps = TABLES_BY_NAME["steps"]
    wanted = o.ttl(steps)
    where = f"database = '{o.database}' AND name = 'steps'"
    current = str(client.command(f"SELECT extract(create_table_query, 'TTL (.*) SETTINGS') FROM system.tables WHERE {where}"))
    if "".join(current.split()) != "".join((wanted or "").split()):
        client.command(_ttl_sql(o))
    client.command(create_view_sql(steps, o))  # also after an ALTER that an interrupted start left without it


# The tables that take a row per step and rank (or per step) and whose merges cost the store most
# (docs/PERFORMANCE.md "Background merges"): the raw steps and the three aggregate tables.
WIDE_MERGE_TABLES = ("steps", AGGREGATES, rank_aggregates.RANK_AGGREGATES, rank_aggregates.RANK_AGGREGATES_COARSE)
MERGE_WIDTH = "merge_selector_base"


def apply_merge_width(client: CommandClient, o: SchemaOptions) -> None:
    """Give `WIDE_MERGE_TABLES` the merge width the options ask for (AREAL_CLICKHOUSE_MERGE_SELECTOR_BASE), or
    the server's own again. Not a migration: the setting may change between two starts of the sink.

    A server whose MergeTree has no such setting (older than the releases that name it) is left alone,
    with a warning when a width was asked for: an ALTER naming a setting the server lacks fails.
    On a cluster the ALTERs always run (ON CLUSTER): a replica keeps its table settings on its own,
    and this node's tables say nothing of a replica added later or one an earlier ALTER missed."""
    known = int(client.command(f"SELECT count() FROM system.merge_tree_settings WHERE name = '{MERGE_WIDTH}'") or 0)
    if not known:
        if o.merge_selector_base is not None:
            log.warning("AREAL_CLICKHOUSE_MERGE_SELECTOR_BASE=%s not applied: this ClickHouse server's MergeTree "
                        "has no %s setting", o.merge_selector_base, MERGE_WIDTH)
        return
    for table in WIDE_MERGE_TABLES:
        where = f"database = '{o.database}' AND name = '{table}'"
        current = str(client.command(f"SELECT extract(create_table_query, '{MERGE_WIDTH} = ([0-9.]+)') "
                                     f"FROM system.tables WHERE {where}") or "")
        if o.cluster or current != ("" if o.merge_selector_base is None else str(o.merge_selector_base)):
            client.command(_merge_width_sql(o, table))


def _merge_width_sql(o: SchemaOptions, table: str) -> str:
    alter = f"ALTER TABLE {o.database}.{table}{o.on_cluster}"
    if o.merge_selector_base is None:
        return f"{alter} RESET SETTING {MERGE_WIDTH}"
    return f"{alter} MODIFY SETTING {MERGE_WIDTH} = {o.merge_selector_base}"


def _ttl_sql(o: SchemaOptions) -> str:
    table, wanted = f"{o.database}.steps{o.on_cluster}", o.ttl(TABLES_BY_NAME["steps"])
    return f"ALTER TABLE {table} MODIFY TTL {wanted}" if wanted else f"ALTER TABLE {table} REMOVE TTL"


def drop_tables(client: CommandClient, options: SchemaOptions = SchemaOptions(), names: Sequence[str] | None = None) -> None:
    """Drop the tables (for `replay`); the views are recreated by `recreate_tables`."""
    if names is None or "steps" in names:  # the per-step aggregates are made from the steps
        for stmt in [*step_means_drops(options), *rank_aggregates.drop_statements(options)]:
            client.command(stmt)
    for t in TABLES:
        if names is None or t.name in names:
            client.command(drop_table_sql(t, options))


def recreate_tables(client: CommandClient, options: SchemaOptions = SchemaOptions()) -> None:
    """Create the per-topic tables and their views again after `drop_tables`."""
    for t in TABLES:
        client.command(create_table_sql(t, options))
    for t in TABLES:
        client.command(create_view_sql(t, options))
    # before any row: the materialized views see every insert
    for stmt in [*step_means_statements(options), *rank_aggregates.create_statements(options),
                 *rank_aggregates.coarse_create_statements(options)]:
        client.command(stmt)
    apply_merge_width(client, options)  # the new tables too: a replay is the heaviest run of inserts
