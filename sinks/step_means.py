"""Per-step aggregates kept at insert time, and `v_step_means`: the one rank mean of each typed step column.

A per-step curve (the reward of a run by step, its KL, its loss...) is the mean over the
step's ranks. Computed from the raw rows at query time its cost grows with ranks x steps;
here it is kept as rows arrive, so a panel's cost grows with steps.

Objects (created by migration 9, rebuilt by `replay`):
- `step_aggregates`: an AggregatingMergeTree keyed by (run_id, attempt, step) whose columns
  are sums (SimpleAggregateFunction), mins, maxes and the set of ranks seen (a bitset, one
  UInt64 word per 64 ranks), kept twice: OR-ed as an aggregate state (`rank_bits`) and summed as
  plain words (`rank_words`, migration 13), which the check below reads;
- `step_aggregates_mv`: the materialized view that adds every block inserted into `steps`;
- `v_step_means`: one row per (run_id, step): its latest attempt's (`attempt` says which);
- `v_step_means_of(runs = [...])` (migration 12): the same for the given runs alone, every read
  (the check for steps delivered twice included) narrowed to those runs: what the dashboards read.

The rule (the stream worker's, `streams/core/ranks.py` `mean_reward`, applied to every typed
column): over the ranks whose value is not null, the mean weighted by `n_samples` when every
one of them gave `n_samples` and they sum to more than 0, else the plain mean. Min and max are
over the same ranks; `ranks` is how many distinct ranks reported the step. The free-form
`metrics` map is kept too: `metrics` holds each key's plain mean over the ranks that logged it
(`metric_counts` of them), `metrics_min` and `metrics_max` its extremes.

Exactly once. Sums add, so a row that reaches the view twice would count twice. The sink's
retried batch carries the same deduplication token, and ClickHouse skips the materialized
view for a block it deduplicates; but a row can still arrive twice in two blocks (a client
that re-sends an event it is unsure of, a step logged twice by one rank, a sink killed between
a block's token and its part, whose restore inserts the rows again). So every aggregate row
also counts the rows added (`rows`) beside the rank words, summed: a step whose `rows` equals
the popcount of its summed words saw each rank once and its sums are exact (a rank added twice
carries a bit away, see `RANK_WORDS`); any other step is computed again from the deduplicated
raw rows (`v_steps`), for that step alone. The
view is thus exactly the raw rows' means whatever was delivered twice, and costs a read of
the raw rows only for steps that were.

A resumed attempt replaces an earlier attempt's step (CONTRACT.md 'Resume'): the view keeps,
per (run_id, step), the highest attempt that has the step.
"""

from __future__ import annotations

from typing import Any

from areal_metrics.producers.contract.events import TYPED_STEP_COLUMNS
from areal_metrics.sinks.schema import TABLES_BY_NAME, SchemaOptions, of_chosen_runs

AGGREGATES = "step_aggregates"
AGGREGATES_MV = "step_aggregates_mv"
STEP_MEANS_VIEW = "v_step_means"
# the same rows for the runs given as its parameter (`v_step_means_of(runs = ['a', 'b'])`): the run
# filter reaches the check for steps delivered twice too, which a query on v_step_means cannot give it
STEP_MEANS_OF_VIEW = "v_step_means_of"
RANK_WORD_BITS = 64  # ranks per word of the rank set

# The columns averaged over ranks: every typed step column but the weight (n_samples), and the epoch.
NOT_AVERAGED = frozenset({"n_samples"})
MEAN_COLUMNS: tuple[str, ...] = tuple(c for c in TYPED_STEP_COLUMNS if c not in NOT_AVERAGED) + ("epoch",)


def _parts(c: str) -> list[tuple[str, str, str]]:
    """(state column, its type, the expression over one block of raw rows) for one averaged column."""
    # source columns qualified (`s.`): an output alias of the same name must not shadow them
    v, x, w = f"s.{c}", f"toFloat64(s.{c})", "s.n_samples"
    return [
        (f"{c}__n", "SimpleAggregateFunction(sum, UInt64)", f"count({v})"),
        (f"{c}__sum", "SimpleAggregateFunction(sum, Float64)", f"sum(ifNull({x}, 0))"),
        (f"{c}__unweighted", "SimpleAggregateFunction(sum, UInt64)", f"countIf({v} IS NOT NULL AND {w} IS NULL)"),
        (f"{c}__w", "SimpleAggregateFunction(sum, UInt64)", f"sum(if({v} IS NULL, 0, ifNull({w}, 0)))"),
        (f"{c}__wsum", "SimpleAggregateFunction(sum, Float64)", f"sum(ifNull({x} * {w}, 0))"),
        (f"{c}__min", "SimpleAggregateFunction(min, Nullable(Float64))", f"min({x})"),
        (f"{c}__max", "SimpleAggregateFunction(max, Nullable(Float64))", f"max({x})"),
    ]


_RANK_BITS = (f"map(toUInt32(intDiv(s.rank, {RANK_WORD_BITS})), "
              f"bitShiftLeft(toUInt64(1), toUInt64(s.rank % {RANK_WORD_BITS})))")
_METRIC_COUNTS = "sumMap(mapApply((k, v) -> (k, toUInt64(1)), {m}))"
# a key's mean over the ranks that logged it (plain: `metrics` carry no weight of their own)
_METRIC_MEANS = ("mapFromArrays(mapKeys(metric_counts), arrayMap(k -> metric_sums[k] / metric_counts[k], "
                 "mapKeys(metric_counts))) AS metrics")
# (column, type, expression over a block) besides the per-column parts
_COMMON: list[tuple[str, str, str]] = [
    ("rows", "SimpleAggregateFunction(sum, UInt64)", "count()"),
    ("rank_bits", "AggregateFunction(groupBitOrMap, Map(UInt32, UInt64))", f"groupBitOrMapState({_RANK_BITS})"),
    ("ts", "SimpleAggregateFunction(max, DateTime64(3, 'UTC'))", "max(s.ts)"),
    ("first_ts", "SimpleAggregateFunction(min, DateTime64(3, 'UTC'))", "min(s.ts)"),
    ("world_size", "SimpleAggregateFunction(max, Nullable(UInt32))", "max(s.world_size)"),
    ("n_samples", "SimpleAggregateFunction(sum, UInt64)", "sum(ifNull(s.n_samples, 0))"),
    # the free-form `metrics`: per key, the sum, the ranks that logged it, min and max
    ("metrics_sum", "SimpleAggregateFunction(sumMap, Map(String, Float64))", "sumMap(s.metrics)"),
    ("metrics_count", "SimpleAggregateFunction(sumMap, Map(String, UInt64))", _METRIC_COUNTS.format(m="s.metrics")),
    ("metrics_min", "SimpleAggregateFunction(minMap, Map(String, Float64))", "minMap(s.metrics)"),
    ("metrics_max", "SimpleAggregateFunction(maxMap, Map(String, Float64))", "maxMap(s.metrics)"),
]


def _state_columns() -> list[tuple[str, str, str]]:
    return _COMMON + [p for c in MEAN_COLUMNS for p in _parts(c)]


# The rank set again as plain words, summed (not OR-ed) as rows merge: what the check for steps delivered
# twice reads. Computed from each inserted row's `rank_bits` (so the materialized view is unchanged, and
# migration 13 fills it for the rows already stored). A sum of disjoint bit sets is their union, and any
# overlap carries a bit away (popcount(a + b) = popcount(a) + popcount(b) - carries, also modulo 2^64), so
# `rows` equals the popcount of the sum exactly when no rank came twice, within one insert or across them.
# Read as a plain map it costs 1/25 of deserializing `rank_bits`' aggregate states (docs/PERFORMANCE.md).
RANK_WORDS = "rank_words"
RANK_WORDS_DDL = (f"`{RANK_WORDS}` SimpleAggregateFunction(sumMap, Map(UInt32, UInt64)) "
                  "MATERIALIZED finalizeAggregation(rank_bits)")


def _popcount(words: str) -> str:
    return f"arraySum(arrayMap(x -> bitCount(x), mapValues({words})))"


def aggregates_table_sql(o: SchemaOptions) -> str:
    return o.aggregating_table(AGGREGATES, ["run_id LowCardinality(String)", "attempt UInt32", "step UInt64"]
                               + [f"`{name}` {typ}" for name, typ, _ in _state_columns()] + [RANK_WORDS_DDL],
                               "run_id, attempt, step")


def rank_words_statements(o: SchemaOptions) -> list[str]:
    """Migration 13: `rank_words` on a store made before it, filled for the rows already there."""
    table = f"{o.database}.{AGGREGATES}{o.on_cluster}"
    return [f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {RANK_WORDS_DDL}",
            f"ALTER TABLE {table} MATERIALIZE COLUMN {RANK_WORDS} SETTINGS mutations_sync = 2"]


def _select_from_steps(o: SchemaOptions) -> str:
    select = ",\n    ".join(["s.run_id AS run_id", "s.attempt AS attempt", "s.step AS step"]
                              + [f"{expr} AS `{name}`" for name, _, expr in _state_columns()])
    return f"SELECT\n    {select}\nFROM {o.database}.steps AS s\nGROUP BY s.run_id, s.attempt, s.step"


def aggregates_mv_sql(o: SchemaOptions) -> str:
    return o.materialized_view(AGGREGATES_MV, AGGREGATES, _select_from_steps(o))


def _mean(c: str, n: str, s: str, unweighted: str, w: str, wsum: str) -> str:
    """The worker's rule over the sums: weighted when every valued rank gave n_samples (and they sum > 0)."""
    return f"if({n} = 0, NULL, if({unweighted} = 0 AND {w} > 0, {wsum} / {w}, {s} / {n})) AS `{c}`"


def _latest_rows() -> str:
    """Each step's columns from its latest attempt's aggregate row, merged at read time (FINAL): `rows`,
    `ranks` and each column's mean, min, max, one row per step without a grouping. (Grouping by step,
    every aggregate -ArgMax by attempt, cost 3.5x the CPU at 100M step rows: a map state per step and
    column; docs/PERFORMANCE.md.)"""
    cols = ["a.run_id AS run_id", "a.attempt AS attempt", "a.step AS step", "a.ts AS ts", "a.first_ts AS first_ts",
            "a.rows AS rows",
            # a step taken from here saw each rank once (the others come from the raw rows): its ranks are its rows
            "toUInt32(a.rows) AS ranks", "a.world_size AS world_size", "a.n_samples AS n_samples"]
    for c in MEAN_COLUMNS:
        part = {k: f"a.`{c}__{k}`" for k in ("n", "sum", "unweighted", "w", "wsum", "min", "max")}
        cols += [_mean(c, part["n"], part["sum"], part["unweighted"], part["w"], part["wsum"]),
                 f"{part['min']} AS `{c}_min`", f"{part['max']} AS `{c}_max`", f"{part['sum']} AS `{c}_sum`"]
    cols += ["a.metrics_sum AS metric_sums", "a.metrics_count AS metric_counts", _METRIC_MEANS,
             "a.metrics_min AS metrics_min", "a.metrics_max AS metrics_max"]
    return ",\n        ".join(cols)


def _from_raw(db: str) -> str:
    """The same columns computed from the deduplicated raw rows (for steps whose rows arrived twice)."""
    cols = ["s.run_id AS run_id", "s.attempt AS attempt", "s.step AS step", "max(s.ts) AS ts",
            "min(s.ts) AS first_ts", "toUInt32(uniqExact(s.rank)) AS ranks",
            "max(s.world_size) AS world_size", "sum(ifNull(s.n_samples, 0)) AS n_samples"]
    for c in MEAN_COLUMNS:
        v, x, w = f"s.{c}", f"toFloat64(s.{c})", "s.n_samples"
        cols += [_mean(c, f"count({v})", f"sum(ifNull({x}, 0))", f"countIf({v} IS NOT NULL AND {w} IS NULL)",
                       f"sum(if({v} IS NULL, 0, ifNull({w}, 0)))", f"sum(ifNull({x} * {w}, 0))"),
                 f"min({x}) AS `{c}_min`", f"max({x}) AS `{c}_max`", f"sum(ifNull({x}, 0)) AS `{c}_sum`"]
    cols += ["sumMap(s.metrics) AS metric_sums", f"{_METRIC_COUNTS.format(m='s.metrics')} AS metric_counts",
             _METRIC_MEANS, "minMap(s.metrics) AS metrics_min", "maxMap(s.metrics) AS metrics_max"]
    return ",\n        ".join(cols)


def _of_runs(of_runs: bool) -> tuple[str, str]:
    """The filter of the aggregate rows `a` by the view's parameter `runs`: as a WHERE, and as the start of
    one (`... AND `); empty for v_step_means."""
    runs = of_chosen_runs("a")
    return (f"WHERE {runs} ", f"{runs} AND ") if of_runs else ("", "")


def delivered_twice_sql(db: str, of_runs: bool) -> str:
    """The (run_id, attempt, step) some rank's row reached the aggregates twice in. Two passes: a step
    kept in one aggregate row (merged, or inserted once) is checked on that row's words alone, a plain
    read; only a step still in several rows sums its words per step (a map sum per group, which over
    every step cost most of a panel's time: docs/PERFORMANCE.md)."""
    runs, runs_and = _of_runs(of_runs)
    return f"""
            SELECT a.run_id, a.attempt, a.step FROM {db}.{AGGREGATES} AS a
            WHERE {runs_and}(a.run_id, a.attempt, a.step) IN (
                SELECT a.run_id, a.attempt, a.step FROM {db}.{AGGREGATES} AS a {runs}GROUP BY a.run_id, a.attempt, a.step
                HAVING count() > 1 OR sum(a.rows) != sum({_popcount(f'a.{RANK_WORDS}')})
            )
            GROUP BY a.run_id, a.attempt, a.step
            HAVING sum(a.rows) != {_popcount(f'sumMap(a.{RANK_WORDS})')}
        """


def output_columns() -> tuple[str, ...]:
    """The columns of `v_step_means`, in order."""
    out = ["run_id", "attempt", "step", "ts", "first_ts", "ranks", "world_size", "n_samples"]
    for c in MEAN_COLUMNS:
        out += [c, f"{c}_min", f"{c}_max", f"{c}_sum"]
    return (*out, "metrics", "metrics_min", "metrics_max", "metric_counts")


def step_means_view_sql(o: SchemaOptions, of_runs: bool = False) -> str:
    """Each step's latest attempt from its merged aggregate row, with the steps that had rows twice taken
    from the raw rows instead;
    `of_runs`: v_step_means_of, every read (the check for steps delivered twice included)
    filtered by its parameter `runs`.

    A LEFT JOIN, not a UNION: ClickHouse reads through a join only the columns a query asks for
    (a panel asks for one or two of ~80), and through a UNION ALL all of them (measured: 4x the CPU)."""
    db, steps_view = o.database, TABLES_BY_NAME["steps"].view
    of_aggregates, of_runs_and = _of_runs(of_runs)
    of_raw = f"{of_chosen_runs('s')} AND " if of_runs else ""
    keys = ("run_id", "attempt", "step")
    picked = ",\n    ".join([f"m.{k} AS {k}" for k in keys] + [
        f"if(f.found = 1, f.`{c}`, m.`{c}`) AS `{c}`" for c in output_columns() if c not in keys])
    raw_names = ", ".join(f"`{c}`" for c in output_columns())
    query = f"""SELECT
    {picked}
FROM
(
    SELECT
        {_latest_rows()}
    FROM {db}.{AGGREGATES} AS a FINAL
    WHERE {of_runs_and}(a.run_id, a.attempt, a.step) IN (
        SELECT a.run_id, max(a.attempt), a.step FROM {db}.{AGGREGATES} AS a {of_aggregates}GROUP BY a.run_id, a.step
    )
) AS m
LEFT JOIN
(
    SELECT {raw_names}, toUInt8(1) AS found FROM
    (
        SELECT
        {_from_raw(db)}
        FROM {db}.{steps_view} AS s
        WHERE {of_raw}(s.run_id, s.attempt, s.step) IN ({delivered_twice_sql(db, of_runs)})
        GROUP BY s.run_id, s.attempt, s.step
    )
) AS f ON f.run_id = m.run_id AND f.attempt = m.attempt AND f.step = m.step"""
    name = STEP_MEANS_OF_VIEW if of_runs else STEP_MEANS_VIEW
    return f"CREATE OR REPLACE VIEW {db}.{name}{o.on_cluster} AS {query}"


def create_statements(o: SchemaOptions) -> list[str]:
    """The table, its materialized view, the views (in that order: the views read the table)."""
    return [aggregates_table_sql(o), aggregates_mv_sql(o), step_means_view_sql(o), step_means_view_sql(o, of_runs=True)]


def drop_statements(o: SchemaOptions) -> list[str]:
    return o.drop_view_and_table(AGGREGATES_MV, AGGREGATES)


def backfill_sql(o: SchemaOptions) -> str:
    """Fill the aggregates from the steps already stored (a store made before migration 9)."""
    return f"INSERT INTO {o.database}.{AGGREGATES} {_select_from_steps(o)}"


StepRow = tuple[str, int, int, int]  # (run_id, attempt, step, rank): a raw step row as the aggregates count it


def counted(client: Any, database: str, rows: set[StepRow]) -> set[StepRow]:
    """Of these step rows, those `step_aggregates` has counted: their rank's bit in their step's summed words.
    A rank counted twice carries its bit away and reads as not counted (adding it again keeps the step
    checked against the raw rows: a carry is never undone)."""
    if not rows:
        return set()
    result = client.query(
        f"SELECT run_id, attempt, step, sumMap({RANK_WORDS}) FROM {database}.{AGGREGATES} "
        "WHERE run_id IN {runs:Array(String)} AND step IN {steps:Array(UInt64)} GROUP BY run_id, attempt, step",
        parameters={"runs": sorted({r[0] for r in rows}), "steps": sorted({r[2] for r in rows})})
    words = {(run, int(attempt), int(step)): w for run, attempt, step, w in result.result_rows}
    return {r for r in rows
            if (words.get(r[:3], {}).get(r[3] // RANK_WORD_BITS, 0) >> (r[3] % RANK_WORD_BITS)) & 1}
