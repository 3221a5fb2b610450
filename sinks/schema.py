"""The ClickHouse schema: one table per topic, views that read FINAL.

Everything here is plain SQL text built from `SchemaOptions`, applied by
`areal_metrics.sinks.migrations.apply_schema(client, options)` to any clickhouse-connect client (embedded chdb
or a server: the same statements on both paths).

Design (see docs/CLICKHOUSE.md):
- `ReplacingMergeTree` whose sorting key ends with `event_id`: a redelivered
  event (same id, same content) collapses into one row in a `FINAL` read, and
  in the background merges. The leading key columns are the ones the dashboards
  filter and order by: run first, then step (or time for the sparse tables).
  Only columns that a re-sent event cannot change are in the key.
- Version column `_offset`: of two rows with one `event_id`, the one later in
  the log wins, the same on every rebuild (live and `replay` agree).
- Trainer input is keyed by what it is about instead: a step by (run_id, step,
  rank), an evaluation result by (run_id, dataset, step, stage, eval_id, node,
  rank), a generation by that and its sample index. Their version `_version`
  is (attempt, offset) in one UInt64 (attempt << 43 | offset), so a resumed
  run's later attempt replaces an earlier attempt's row, a re-sent event
  collapses as before, and a step logged twice keeps its later (merged) event.
- `generations` is projected from `eval` events (one row per sample), not a
  topic of its own; `v_runs` is one row per run, folded from the `run` events.
- Partitioned by run (`PARTITION BY cityHash64(run_id) % 16`, schema version
  4), never by time: `FINAL` deduplicates within a partition only, so every
  version of a row (a re-sent event, a resumed attempt's replacement, a
  re-emitted derived event with a new `ts`) must land in the partition of the
  row it replaces, and only a function of the sorting key guarantees that.
  A query for some runs reads only their partitions (and, inside them, only
  their key range); `FINAL` merges only where parts overlap, and a partition
  of one merged part is read without merging.
- Raw steps may expire: `SchemaOptions.steps_ttl_days` (AREAL_CLICKHOUSE_STEPS_TTL_DAYS,
  off by default) sets `TTL ts + N days` on `steps`, and `v_steps` hides rows
  past it, so a read does not depend on which parts a merge has cleaned yet.
- `non_replicated_deduplication_window`: without it a plain MergeTree ignores
  `insert_deduplication_token`, and a retried batch would be stored twice.
- Migrations are numbered, each statement is idempotent (`IF NOT EXISTS`), and
  the applied versions are recorded in `schema_migrations`, so running
  `apply_schema` (sinks/migrations.py) twice, or from two processes, is harmless.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.sinks.views import COMMAND_STATUS_VIEW, RUNS_VIEW, final_view

SCHEMA_VERSION = 15  # the newest migration
DEFAULT_DATABASE = "areal"
DEDUP_WINDOW = 10_000  # insert blocks remembered per table for token deduplication

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Every table has run_id first in its sorting key: partitions by run keep each row's versions together.
RUN_BUCKETS = 16
PARTITION_BY = f"cityHash64(run_id) % {RUN_BUCKETS}"


def of_chosen_runs(alias: str) -> str:
    """The rows `alias` of the runs a parameterized view is given (`v_step_means_of(runs = [...])`,
    `v_rank_buckets_of`, `v_rank_buckets_coarse_of`): the one spelling of that parameter."""
    return f"{alias}.run_id IN {{runs:Array(String)}}"


class CommandClient(Protocol):
    def command(self, cmd: str, *args: Any, **kwargs: Any) -> Any: ...


class StoreSettings(Protocol):
    """What `SchemaOptions.from_settings` reads; `areal_metrics.producers.contract.settings.Settings` has these fields."""

    clickhouse_cluster: str | None
    clickhouse_replicated: bool
    clickhouse_steps_ttl_days: int | None
    clickhouse_merge_selector_base: int | None


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str
    # where the value comes from: the record field of the same name (default),
    # or a Kafka provenance value filled by the sink
    server_default: str | None = None  # filled by ClickHouse, not sent by the sink

    def ddl(self) -> str:
        default = f" DEFAULT {self.server_default}" if self.server_default else ""
        return f"`{self.name}` {self.type}{default}"


@dataclass(frozen=True, slots=True)
class Table:
    name: str
    event_type: str  # the `type` field of the events it stores (or is projected from)
    columns: tuple[Column, ...]
    order_by: tuple[str, ...]
    version: str = "_offset"  # ReplacingMergeTree's version column
    projected: bool = False  # rows derived from another table's events (generations from evals)

    @property
    def insert_columns(self) -> tuple[str, ...]:
        """Columns the sink sends (those without a server default)."""
        return tuple(c.name for c in self.columns if c.server_default is None)

    @property
    def view(self) -> str:
        return f"v_{self.name}"


def _cols(spec: str) -> tuple[Column, ...]:
    """'name Type, name2 Type2' (types may contain commas inside parentheses)."""
    out: list[Column] = []
    depth, start = 0, 0
    for i, ch in enumerate(spec + ","):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            part = spec[start:i].strip()
            start = i + 1
            if part:
                name, _, typ = part.partition(" ")
                out.append(Column(name, typ.strip()))
    return tuple(out)


LC = "LowCardinality(String)"
F = "Nullable(Float64)"
ENVELOPE = _cols(
    f"event_id String, run_id {LC}, node {LC}, rank UInt32, ts DateTime64(3, 'UTC'), schema UInt16"
)
PROVENANCE = (
    Column("_topic", LC),
    Column("_partition", "UInt32"),
    Column("_offset", "UInt64"),
    Column("_ingested_at", "DateTime64(3, 'UTC')", server_default="now64(3, 'UTC')"),
)


# (attempt, offset) as one number: a later attempt wins, then the later log position.
# Offsets stay below 2**43 (8.8e12 messages per partition), attempts below 2**20.
VERSION = Column("_version", "UInt64", server_default="bitShiftLeft(toUInt64(attempt), 43) + _offset")


def _table(name: str, event_type: str, spec: str, order_by: str, *, by_attempt: bool = False,
           projected: bool = False) -> Table:
    columns = ENVELOPE + _cols(spec) + PROVENANCE + ((VERSION,) if by_attempt else ())
    return Table(name, event_type, columns, tuple(order_by.split(", ")), "_version" if by_attempt else "_offset",
                 projected)


# Column names are the JSON field names of CONTRACT.md; optional fields are Nullable.
TABLES: tuple[Table, ...] = (
    _table(
        "steps",
        "step",
        f"step UInt64, epoch Float64, reward {F}, reward_std {F}, entropy {F}, advantage_mean {F}, "
        f"advantage_std {F}, kl {F}, clip_ratio {F}, loss {F}, lr {F}, grad_norm {F}, response_length {F}, "
        f"tokens Nullable(UInt64), throughput {F}, latency_ms {F}, gpu_mem_bytes Nullable(UInt64), "
        "metrics Map(String, Float64), world_size Nullable(UInt32), attempt UInt32, non_finite Array(String), "
        "n_samples Nullable(UInt64)",
        "run_id, step, rank",
        by_attempt=True,
    ),
    _table(
        "evals",
        "eval",
        f"eval_id String, step UInt64, dataset {LC}, stage {LC}, status {LC}, accuracy {F}, "
        f"response_length {F}, reward {F}, n_samples Nullable(UInt32), latency_ms {F}, "
        "verdicts Array(UInt8), error Nullable(String), replicas UInt32, dataset_fingerprint Nullable(String), "
        "metrics Map(String, Float64), attempt UInt32, sample_ids Array(UInt32), shard_nodes Nullable(UInt32)",
        "run_id, dataset, step, stage, eval_id, node, rank",
        by_attempt=True,
    ),
    _table(
        "eval_consensus",
        "eval_consensus",
        f"eval_id String, step UInt64, dataset {LC}, stage {LC}, accuracy Float64, response_length {F}, "
        "votes UInt32, replicas UInt32, agreement Float64, dissenters Array(String), stale Bool, partial Bool, "
        f"n_samples Nullable(UInt32), n_undecided Nullable(UInt32), ci_low {F}, ci_high {F}, "
        "metrics Map(String, Float64)",
        "run_id, dataset, step, event_id",
    ),
    _table(
        "rewards_smoothed",
        "reward_smoothed",
        "step UInt64, reward Float64, window UInt32, sliding_avg Float64, ema Float64, slope Float64",
        "run_id, step, event_id",
    ),
    _table(
        "commands",
        "command",
        f"command {LC}, target_node Nullable(String), args String, reason String",
        "run_id, command, event_id",
    ),
    _table(
        "alerts",
        "alert",
        f"alert_id String, kind {LC}, severity {LC}, message String, step Nullable(UInt64), value {F}, threshold {F}",
        "run_id, kind, event_id",
    ),
    _table(
        "deadletter",
        "rejected",
        f"reason String, source_topic {LC}, raw String",
        "run_id, event_id",
    ),
    _table(
        "runs",
        "run",
        f"status {LC}, config String, tags Array(String), group Nullable(String), world_size UInt32, "
        f"host Nullable(String), attempt UInt32, framework Nullable(String), git_commit Nullable(String), "
        "exit_code Nullable(Int32), name Nullable(String), notes Nullable(String), summary Nullable(String)",
        "run_id, event_id",
    ),
    # trainers' acknowledgements of commands (topic `acks`): which node applied which command, when
    _table(
        "command_acks",
        "command_ack",
        f"command_id String, command {LC}, status {LC}, step Nullable(UInt64), lr_factor {F}, detail String, "
        "attempt UInt32",
        "run_id, command_id, event_id",
    ),
    # one row per sample of an eval event (its `samples`): what W&B users see as sample tables
    _table(
        "generations",
        "eval",
        f"eval_id String, step UInt64, dataset {LC}, stage {LC}, sample UInt32, prompt String, response String, "
        f"verdict Nullable(UInt8), reward {F}, attempt UInt32, gold String, error_type {LC}",
        "run_id, dataset, step, stage, eval_id, node, rank, sample",
        by_attempt=True,
        projected=True,
    ),
)
# Fields of an event that its table does not hold as a column: stored elsewhere.
NOT_COLUMNS: dict[str, frozenset[str]] = {
    "evals": frozenset({"samples"}),  # samples: the generations table
}
TABLES_BY_NAME: dict[str, Table] = {t.name: t for t in TABLES}
TABLES_BY_EVENT_TYPE: dict[str, Table] = {t.event_type: t for t in TABLES if not t.projected}
PROJECTIONS: dict[str, tuple[Table, ...]] = {
    event_type: tuple(t for t in TABLES if t.projected and t.event_type == event_type)
    for event_type in {t.event_type for t in TABLES if t.projected}
}

# The sink's own bookkeeping: the last planned batch per partition, so a retry
# after a crash rebuilds exactly the same batch (same rows, same token).
BATCH_PLANS = "_sink_batches"
MIGRATIONS_TABLE = "schema_migrations"


@dataclass(frozen=True, slots=True)
class SchemaOptions:
    """Where and how to create the schema.

    `cluster`: add `ON CLUSTER <cluster>` to every DDL statement.
    `replicated`: use `ReplicatedReplacingMergeTree` with the usual
    `{shard}`/`{replica}` macros (replicated tables deduplicate inserts by
    token through Keeper, window `replicated_deduplication_window`).
    """

    database: str = DEFAULT_DATABASE
    cluster: str | None = None
    replicated: bool = False
    zk_path: str = "/clickhouse/tables/{shard}/{database}/{table}"
    steps_ttl_days: int | None = None  # raw steps older than this many days expire; None: kept
    merge_selector_base: int | None = None  # the wide tables' merge width (migrations.apply_merge_width); None: the server's

    @classmethod
    def from_settings(cls, settings: StoreSettings, database: str = DEFAULT_DATABASE, *,
                      embedded: bool = False) -> SchemaOptions:
        """The options `Settings` ask for (AREAL_CLICKHOUSE_CLUSTER, AREAL_CLICKHOUSE_REPLICATED).

        `embedded`: the store is the embedded engine (chdb), one process on one machine with
        no Keeper and no cluster, so a cluster or replication setting is refused (ConfigError).
        """
        if embedded and (settings.clickhouse_cluster or settings.clickhouse_replicated):
            raise ConfigError(
                "AREAL_CLICKHOUSE_CLUSTER / AREAL_CLICKHOUSE_REPLICATED need a ClickHouse server (an http(s):// "
                "AREAL_CLICKHOUSE_URL); the embedded engine (chdb://) is one node without Keeper")
        try:
            return cls(database=database, cluster=settings.clickhouse_cluster,
                       replicated=settings.clickhouse_replicated, steps_ttl_days=settings.clickhouse_steps_ttl_days,
                       merge_selector_base=settings.clickhouse_merge_selector_base)
        except ValueError as exc:
            raise ConfigError(f"AREAL_CLICKHOUSE_CLUSTER: {exc}") from None  # the TTL and merge width: by Settings

    def __post_init__(self) -> None:
        if self.steps_ttl_days is not None and (isinstance(self.steps_ttl_days, bool) or
                                                 not isinstance(self.steps_ttl_days, int) or self.steps_ttl_days < 1):
            raise ValueError(f"steps_ttl_days must be a whole number of days >= 1 (got {self.steps_ttl_days!r})")
        if self.merge_selector_base is not None and (isinstance(self.merge_selector_base, bool) or not isinstance(
                self.merge_selector_base, int) or not 2 <= self.merge_selector_base <= 1000):
            raise ValueError(f"merge_selector_base must be a whole number from 2 to 1000 (got {self.merge_selector_base!r})")
        if not _IDENT.fullmatch(self.database):
            raise ValueError(f"database name {self.database!r} must match {_IDENT.pattern}")
        if self.cluster is not None and not _IDENT.fullmatch(self.cluster):
            raise ValueError(f"cluster name {self.cluster!r} must match {_IDENT.pattern}")

    def ttl(self, table: Table) -> str | None:
        """The table's TTL expression, or None (only raw steps expire, and only when configured)."""
        if table.name != "steps" or self.steps_ttl_days is None:
            return None
        return f"toDateTime(ts) + toIntervalDay({self.steps_ttl_days})"

    @property
    def on_cluster(self) -> str:
        return f" ON CLUSTER {self.cluster}" if self.cluster else ""

    def engine(self, table: str, kind: str = "ReplacingMergeTree", args: str = "") -> str:
        if self.replicated:
            path = self.zk_path.replace("{database}", self.database).replace("{table}", table)
            inner = f"'{path}', '{{replica}}'" + (f", {args}" if args else "")
            return f"Replicated{kind}({inner})"
        return f"{kind}({args})"

    def dedup_settings(self) -> str:
        if self.replicated:
            return f"replicated_deduplication_window = {DEDUP_WINDOW}"
        return f"non_replicated_deduplication_window = {DEDUP_WINDOW}"

    # An aggregate kept at insert time (sinks/step_means.py, sinks/rank_aggregates.py): its table, the
    # materialized view over `steps` that fills it, and the two dropped for `replay`, view first.
    def aggregating_table(self, table: str, columns: list[str], order_by: str) -> str:
        cols = ",\n    ".join(columns)
        return (
            f"CREATE TABLE IF NOT EXISTS {self.database}.{table}{self.on_cluster} (\n    {cols}\n)\n"
            f"ENGINE = {self.engine(table, kind='AggregatingMergeTree')}\n"
            f"PARTITION BY {PARTITION_BY}\n"
            f"ORDER BY ({order_by})\n"
            f"SETTINGS {self.dedup_settings()}"  # a retried block's token drops it here too (see sinks/writer.py)
        )

    def materialized_view(self, view: str, table: str, select: str) -> str:
        return (f"CREATE MATERIALIZED VIEW IF NOT EXISTS {self.database}.{view}{self.on_cluster} "
                f"TO {self.database}.{table} AS\n{select}")

    def drop_view_and_table(self, view: str, table: str) -> list[str]:
        """For `replay`: the materialized view first (it writes into the table), then the table."""
        return [f"DROP VIEW IF EXISTS {self.database}.{view}{self.on_cluster} SYNC",
                f"DROP TABLE IF EXISTS {self.database}.{table}{self.on_cluster} SYNC"]


# Grafana's time filter (`$__timeFilter(ts)`) skips granules by this min/max index;
# `ts` is not in the sorting key because a re-emitted derived event may carry a new one.
TS_INDEX = "INDEX ts_minmax ts TYPE minmax GRANULARITY 1"


def create_table_sql(table: Table, o: SchemaOptions, name: str | None = None) -> str:
    name = name or table.name
    cols = ",\n    ".join([c.ddl() for c in table.columns] + [TS_INDEX])
    ttl = o.ttl(table)
    return (
        f"CREATE TABLE IF NOT EXISTS {o.database}.{name}{o.on_cluster} (\n    {cols}\n)\n"
        f"ENGINE = {o.engine(name, args=table.version)}\n"
        f"PARTITION BY {PARTITION_BY}\n"
        f"ORDER BY ({', '.join(table.order_by)})\n"
        + (f"TTL {ttl}\n" if ttl else "")
        + f"SETTINGS {o.dedup_settings()}"
    )


def create_view_sql(table: Table, o: SchemaOptions) -> str:
    # CREATE OR REPLACE: a later migration (or another TTL) may change the view's query
    if table.name == "runs":
        query = RUNS_VIEW.format(db=o.database)
    else:
        query = final_view(o.database, table.name, o.ttl(table))
    return f"CREATE OR REPLACE VIEW {o.database}.{table.view}{o.on_cluster} AS {query}"




def command_status_view_sql(o: SchemaOptions) -> str:
    """`v_command_status`: per command, the nodes that applied it (at which step) and those that ignored it."""
    return f"CREATE OR REPLACE VIEW {o.database}.v_command_status{o.on_cluster} AS {COMMAND_STATUS_VIEW.format(db=o.database)}"


def drop_table_sql(table: Table, o: SchemaOptions) -> str:
    return f"DROP TABLE IF EXISTS {o.database}.{table.name}{o.on_cluster} SYNC"


def plans_sql(o: SchemaOptions) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {o.database}.{BATCH_PLANS}{o.on_cluster} (\n"
        f"    consumer_group String, topic String, partition UInt32,\n"
        f"    first_offset UInt64, last_offset UInt64, planned_at DateTime64(6, 'UTC') DEFAULT now64(6, 'UTC')\n"
        f")\nENGINE = {o.engine(BATCH_PLANS, args='planned_at')}\n"
        f"ORDER BY (consumer_group, topic, partition)"
    )
