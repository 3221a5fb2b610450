"""Per-rank aggregates kept at insert time, and `v_rank_buckets`: each rank's steps in buckets of 64.

The efficiency dashboard draws one line per node and rank (throughput, step latency, memory,
tokens per step) and a table with one line per rank. Read from the raw rows their cost grows
with every row in the time range; here each rank's steps are summed as rows arrive, 64 steps to
a row (`BUCKET_STEPS`), so a panel reads 1/64 of the rows (measured in docs/PERFORMANCE.md).

Objects (created by migration 11, rebuilt by `replay`):
- `rank_aggregates`: an AggregatingMergeTree keyed by (run_id, rank, bucket, attempt, node),
  `bucket = intDiv(step, 64)`, whose columns are counts, sums, the maximum memory and step
  latency, and the set of steps seen (one UInt64, a bit per step). No quantile state: one holds
  every value (measured: merging them cost more than reading the raw rows), so the rank table
  shows the mean and the maximum step latency, both exact from the sums;
- `rank_aggregates_mv`: the materialized view that adds every block inserted into `steps`;
- `v_rank_buckets`: one row per (run_id, node, rank, bucket) of exactly the rows `v_steps`
  shows (a later attempt's step replaces an earlier one's);
- `v_rank_buckets_of(runs = [...])`: the same for the given runs alone, every read (the check
  for buckets delivered twice among them) narrowed to those runs: what the dashboards read.

A long range (a week of every run at 1,000 ranks) would still read a row per rank and 64 steps:
100M step rows are 1.6M bucket rows. So a coarse level (migration 14) keeps 512 steps to a row
(`COARSE_BUCKETS` buckets of 64), filled from the fine level, not from the raw rows again:
- `rank_aggregates_coarse`: the same columns, keyed by the coarse bucket, with the steps seen as
  8 words (`step_bits_0` ... `step_bits_7`, one per fine bucket);
- `rank_aggregates_coarse_mv`: the materialized view that adds every block the fine level's view
  writes into `rank_aggregates` (a cascade: the fine rows of a block, not its raw rows);
- `v_rank_buckets_coarse_of(runs = [...])`: a row per coarse bucket whose rows are on one node and
  each of whose 512 steps came once; every other coarse bucket as its fine rows (the fine level's
  own rule: from the sums when exact, else from the raw rows). The efficiency board reads it for
  ranges over `$rank_coarse_rows` step rows.

Exactly once, as `step_aggregates` (sinks/step_means.py): the sink's retried block carries its
deduplication token and is dropped here too; a row that still arrives twice (in another block)
makes its bucket's `rows` exceed the number of distinct steps in `step_bits`. A bucket is taken
from the sums when its rows are on one node and each of its steps came once (a step that a
resumed attempt replaced came twice); any other bucket is computed again
from the deduplicated raw rows, read through the primary key for those 64 steps alone (a set of
buckets, not of their 64 steps each: the same granules read, half the CPU at 10M rows).
"""

from __future__ import annotations

from typing import Any

from areal_metrics.producers.contract.rank_rules import BUCKET_STEPS, SUMMED, memory_sql
from areal_metrics.sinks.schema import TABLES_BY_NAME, SchemaOptions, of_chosen_runs
from areal_metrics.sinks.step_means import StepRow

RANK_AGGREGATES = "rank_aggregates"
RANK_AGGREGATES_MV = "rank_aggregates_mv"
RANK_BUCKETS_VIEW = "v_rank_buckets"
# the same rows for the runs given as its parameter (`v_rank_buckets_of(runs = ['a', 'b'])`): the run
# filter reaches the check for buckets delivered twice too, which a query on v_rank_buckets cannot give it
RANK_BUCKETS_OF_VIEW = "v_rank_buckets_of"
MEMORY = memory_sql("s")  # of one raw row `s` (the rule the board's raw-row queries share)


def _block_columns() -> list[tuple[str, str, str]]:
    """(state column, its type, the expression over one block of raw rows `s`)."""
    cols = [
        ("rows", "SimpleAggregateFunction(sum, UInt64)", "count()"),
        ("step_bits", "SimpleAggregateFunction(groupBitOr, UInt64)",
         f"groupBitOr(bitShiftLeft(toUInt64(1), toUInt64(s.step % {BUCKET_STEPS})))"),
        ("ts", "SimpleAggregateFunction(max, DateTime64(3, 'UTC'))", "max(s.ts)"),
        ("first_ts", "SimpleAggregateFunction(min, DateTime64(3, 'UTC'))", "min(s.ts)"),
        ("memory", "SimpleAggregateFunction(max, Nullable(Float64))", f"max({MEMORY})"),
        ("latency_max", "SimpleAggregateFunction(max, Nullable(Float64))", "max(toFloat64(s.latency_ms))"),
    ]
    for c in SUMMED:
        cols += [(f"{c}_n", "SimpleAggregateFunction(sum, UInt64)", f"count(s.{c})"),
                 (f"{c}_sum", "SimpleAggregateFunction(sum, Float64)", f"sum(ifNull(toFloat64(s.{c}), 0))")]
    return cols


COARSE_BUCKETS = 8  # fine buckets (of BUCKET_STEPS) to a coarse one: 512 steps, a word of step bits each
RANK_AGGREGATES_COARSE = "rank_aggregates_coarse"
RANK_AGGREGATES_COARSE_MV = "rank_aggregates_coarse_mv"
RANK_BUCKETS_COARSE_OF_VIEW = "v_rank_buckets_coarse_of"
_WORDS = tuple(f"step_bits_{k}" for k in range(COARSE_BUCKETS))


def _coarse_columns() -> list[tuple[str, str, str]]:
    """(state column, its type, the expression over fine rows `f`): the fine columns added up, the steps
    seen as a word per fine bucket."""
    out: list[tuple[str, str, str]] = []
    for name, typ, _ in _block_columns():
        if name == "step_bits":
            out += [(w, typ, f"groupBitOr(if(f.bucket % {COARSE_BUCKETS} = {k}, f.step_bits, toUInt64(0)))")
                    for k, w in enumerate(_WORDS)]
        else:
            fn = typ.removeprefix("SimpleAggregateFunction(").split(",")[0]  # sum, max or min, as the fine rows merge
            out.append((name, typ, f"{fn}(f.`{name}`)"))
    return out


def _table_sql(o: SchemaOptions, name: str, columns: list[tuple[str, str, str]]) -> str:
    """A level's table (fine or coarse: the same key)."""
    return o.aggregating_table(name, ["run_id LowCardinality(String)", "node LowCardinality(String)",
                                      "rank UInt32", "attempt UInt32", "bucket UInt64"]
                               + [f"`{n}` {t}" for n, t, _ in columns], "run_id, rank, bucket, attempt, node")


def _grouped_select(source: str, alias: str, bucket: str, columns: list[tuple[str, str, str]]) -> str:
    """A level's rows from `source` (as `alias`), grouped by its key, `bucket` the bucket's expression."""
    a = alias
    select = ",\n    ".join([f"{a}.run_id AS run_id", f"{a}.node AS node", f"{a}.rank AS rank",
                              f"{a}.attempt AS attempt", f"{bucket} AS bucket"]
                             + [f"{e} AS `{n}`" for n, _, e in columns])
    return f"SELECT\n    {select}\nFROM {source} AS {a}\nGROUP BY {a}.run_id, {a}.node, {a}.rank, {a}.attempt, bucket"


def table_sql(o: SchemaOptions) -> str:
    return _table_sql(o, RANK_AGGREGATES, _block_columns())


def _select_from_steps(o: SchemaOptions) -> str:
    return _grouped_select(f"{o.database}.steps", "s", f"intDiv(s.step, {BUCKET_STEPS})", _block_columns())


def mv_sql(o: SchemaOptions) -> str:
    return o.materialized_view(RANK_AGGREGATES_MV, RANK_AGGREGATES, _select_from_steps(o))


def coarse_table_sql(o: SchemaOptions) -> str:
    return _table_sql(o, RANK_AGGREGATES_COARSE, _coarse_columns())


def _select_from_fine(o: SchemaOptions) -> str:
    return _grouped_select(f"{o.database}.{RANK_AGGREGATES}", "f", f"intDiv(f.bucket, {COARSE_BUCKETS})",
                           _coarse_columns())


def coarse_mv_sql(o: SchemaOptions) -> str:
    return o.materialized_view(RANK_AGGREGATES_COARSE_MV, RANK_AGGREGATES_COARSE, _select_from_fine(o))


def coarse_backfill_sql(o: SchemaOptions) -> str:
    """Fill the coarse level from the fine one already stored (a store made before migration 14)."""
    return f"INSERT INTO {o.database}.{RANK_AGGREGATES_COARSE} {_select_from_fine(o)}"


def backfill_sql(o: SchemaOptions) -> str:
    """Fill the aggregates from the steps already stored (a store made before migration 11)."""
    return f"INSERT INTO {o.database}.{RANK_AGGREGATES} {_select_from_steps(o)}"


# a bucket the sums give exactly: one node, each step once. `v_steps` keeps one row per (run, step, rank),
# the latest attempt's, so a bucket whose steps each came once holds exactly its rows, whatever the
# attempts; a step a later attempt replaced came twice. (Plain sums: -ArgMax by attempt cost 35 ms
# against 28 for the grouping of a 2M-row store's aggregates.)
_EXACT = "min(a.node) = max(a.node) AND sum(a.rows) = bitCount(groupBitOr(a.step_bits))"
# the same for a coarse bucket: one node, each of its 512 steps once
_EXACT_COARSE = "min(a.node) = max(a.node) AND sum(a.rows) = " + " + ".join(f"bitCount(groupBitOr(a.{w}))" for w in _WORDS)


def _from_sums(bucket: str = "a.bucket") -> list[str]:
    """A bucket's columns from its aggregate rows `a` (fine or coarse: the same columns)."""
    out = ["a.run_id AS run_id", "any(a.node) AS node", "a.rank AS rank", f"{bucket} AS bucket",
           "max(a.ts) AS ts", "min(a.first_ts) AS first_ts", "sum(a.rows) AS steps",
           "max(a.memory) AS memory", "max(a.latency_max) AS latency_max"]
    return out + [f"sum(a.`{c}_{k}`) AS `{c}_{k}`" for c in SUMMED for k in ("n", "sum")]


def _fine_query(o: SchemaOptions, of_runs: bool, within: str = "") -> str:
    """The exact buckets from the sums, UNION ALL the others from the deduplicated raw rows; `of_runs`:
    every read filtered by the parameter `runs`; `within`: a condition on the aggregate rows `a` too."""
    db, steps_view = o.database, TABLES_BY_NAME["steps"].view
    where_a = " AND ".join(c for c in (of_chosen_runs("a") if of_runs else "", within) if c)
    runs = (f"WHERE {where_a}\n" if where_a else "", f"{of_chosen_runs('s')} AND " if of_runs else "")
    from_sums = _from_sums()
    from_raw = ["s.run_id AS run_id", "s.node AS node", "s.rank AS rank", f"intDiv(s.step, {BUCKET_STEPS}) AS bucket",
                "max(s.ts) AS ts", "min(s.ts) AS first_ts", "count() AS steps", f"max({MEMORY}) AS memory",
                "max(toFloat64(s.latency_ms)) AS latency_max"]
    from_raw += [e for c in SUMMED for e in (f"count(s.{c}) AS `{c}_n`", f"sum(ifNull(toFloat64(s.{c}), 0)) AS `{c}_sum`")]
    sep = ",\n    "
    query = f"""SELECT
    {sep.join(from_sums)}
FROM {db}.{RANK_AGGREGATES} AS a
{runs[0]}GROUP BY a.run_id, a.rank, a.bucket
HAVING {_EXACT}
UNION ALL
SELECT
    {sep.join(from_raw)}
FROM {db}.{steps_view} AS s
WHERE {runs[1]}(s.run_id, s.rank, intDiv(s.step, {BUCKET_STEPS})) IN (
    SELECT a.run_id, a.rank, a.bucket
    FROM {db}.{RANK_AGGREGATES} AS a
    {runs[0]}    GROUP BY a.run_id, a.rank, a.bucket
    HAVING NOT ({_EXACT})
)
GROUP BY s.run_id, s.node, s.rank, bucket"""
    return query


def view_sql(o: SchemaOptions, of_runs: bool = False) -> str:
    """v_rank_buckets; `of_runs`: v_rank_buckets_of, every read filtered by its parameter `runs`."""
    name = RANK_BUCKETS_OF_VIEW if of_runs else RANK_BUCKETS_VIEW
    return f"CREATE OR REPLACE VIEW {o.database}.{name}{o.on_cluster} AS {_fine_query(o, of_runs)}"


def coarse_view_sql(o: SchemaOptions) -> str:
    """v_rank_buckets_coarse_of(runs): the exact coarse buckets from their sums (`bucket`: their first fine
    bucket), UNION ALL every other coarse bucket as the fine level gives it."""
    db, sep = o.database, ",\n    "
    runs = of_chosen_runs("a")
    not_exact = (f"(a.run_id, a.rank, intDiv(a.bucket, {COARSE_BUCKETS})) IN (\n"
                 f"    SELECT a.run_id, a.rank, a.bucket FROM {db}.{RANK_AGGREGATES_COARSE} AS a WHERE {runs}\n"
                 f"    GROUP BY a.run_id, a.rank, a.bucket HAVING NOT ({_EXACT_COARSE}))")
    query = f"""SELECT
    {sep.join(_from_sums(f"a.bucket * {COARSE_BUCKETS}"))}
FROM {db}.{RANK_AGGREGATES_COARSE} AS a
WHERE {runs}
GROUP BY a.run_id, a.rank, a.bucket
HAVING {_EXACT_COARSE}
UNION ALL
{_fine_query(o, of_runs=True, within=not_exact)}"""
    return f"CREATE OR REPLACE VIEW {db}.{RANK_BUCKETS_COARSE_OF_VIEW}{o.on_cluster} AS {query}"


def create_statements(o: SchemaOptions) -> list[str]:
    """The table, its materialized view, the views (in that order: the views read the table)."""
    return [table_sql(o), mv_sql(o), view_sql(o), view_sql(o, of_runs=True)]


def coarse_create_statements(o: SchemaOptions) -> list[str]:
    """The coarse level: its table, its materialized view (after the fine table it reads), its view."""
    return [coarse_table_sql(o), coarse_mv_sql(o), coarse_view_sql(o)]


def coarse_migration_statements(o: SchemaOptions) -> list[str]:
    """Migration 14: the coarse level, filled from the fine rows already stored before its view is made. As
    in migration 11, a fine row the backfill adds beside the materialized view makes its coarse bucket
    inexact, so the view takes that bucket from the fine level: no pause needed."""
    table, mv, view = coarse_create_statements(o)
    return [table, mv, coarse_backfill_sql(o), view]


def drop_statements(o: SchemaOptions) -> list[str]:
    return [*o.drop_view_and_table(RANK_AGGREGATES_COARSE_MV, RANK_AGGREGATES_COARSE),
            *o.drop_view_and_table(RANK_AGGREGATES_MV, RANK_AGGREGATES)]


def counted(client: Any, database: str, rows: set[StepRow]) -> set[StepRow]:
    """Of these step rows, those both levels have counted: their step's bit in their fine bucket's
    `step_bits`, and in their coarse bucket's word for that fine bucket (on any node)."""
    if not rows:
        return set()
    runs = sorted({r[0] for r in rows})

    def bits(table: str, words: tuple[str, ...], per_bucket: int) -> dict[tuple[str, int, int, int], tuple[int, ...]]:
        cols = ", ".join(f"groupBitOr({w})" for w in words)
        result = client.query(
            f"SELECT run_id, rank, attempt, bucket, {cols} FROM {database}.{table} WHERE run_id IN "
            "{runs:Array(String)} AND bucket IN {buckets:Array(UInt64)} GROUP BY run_id, rank, attempt, bucket",
            parameters={"runs": runs, "buckets": sorted({r[2] // per_bucket for r in rows})})
        return {(run, int(rank), int(attempt), int(bucket)): tuple(int(w) for w in ws)
                for run, rank, attempt, bucket, *ws in result.result_rows}

    fine = bits(RANK_AGGREGATES, ("step_bits",), BUCKET_STEPS)
    coarse_steps = BUCKET_STEPS * COARSE_BUCKETS
    coarse = bits(RANK_AGGREGATES_COARSE, _WORDS, coarse_steps)

    def has(run: str, attempt: int, step: int, rank: int) -> bool:
        bit = 1 << (step % BUCKET_STEPS)
        word = fine.get((run, rank, attempt, step // BUCKET_STEPS), (0,))[0]
        words = coarse.get((run, rank, attempt, step // coarse_steps), (0,) * COARSE_BUCKETS)
        return bool(word & bit) and bool(words[(step // BUCKET_STEPS) % COARSE_BUCKETS] & bit)

    return {r for r in rows if has(*r)}
