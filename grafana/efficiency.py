"""Efficiency: throughput (tokens/s), step latency and memory per node and rank."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.models import dashboard

from areal_metrics.grafana.clickhouse import SQL, Format, stored, view, view_of_chosen_runs
from areal_metrics.grafana.panels import NODE_FILTER, RUN_FILTER, STEP_MEANS, base, table, timeseries
from areal_metrics.producers.contract.rank_rules import SUMMED, memory_sql

UID = "areal-efficiency"
TS = Format.TIME_SERIES
WORKER = "concat(run_id, ' · ', node, ' · rank ', toString(rank))"
MEMORY = memory_sql()  # the rule the per-rank aggregates keep (producers/contract/rank_rules.py)

# Three bounds, each a dashboard variable (docs/GRAFANA.md 'Efficiency'):
# - `rank_raw_rows` (constant, hidden): the per-rank panels read one row per step (the raw rows) when
#   the chosen runs hold at most this many step rows in the time range, else the per-rank aggregates
#   (v_rank_buckets: one row per run, node, rank and 64 steps, exactly the deduplicated raw rows' sums,
#   a point at its bucket's last step);
# - `rank_coarse_rows` (constant, hidden): above this many step rows in the range, the coarse level
#   (v_rank_buckets_coarse: 512 steps to a row where exact, else the 64-step rows);
# - `ranks` (a text box): the per-rank panels draw, and the table lists, at most this many ranks.
RAW_ROWS_DEFAULT = 250_000
COARSE_ROWS_DEFAULT = 5_000_000
RANKS_DEFAULT = 20
# The step rows the range holds for the chosen runs, from the per-step aggregates (a row per step,
# not per rank): every attempt's and every repeated row counted, so never fewer than v_steps has.
RANGE_ROWS = f"(SELECT sum(rows) FROM {stored('step_aggregates')} WHERE $__timeFilter(ts) AND {RUN_FILTER})"
# a value that is no number (an empty text box, a typo) is the default, never an error in a panel
RAW_ROWS = f"toUInt64OrDefault(${{rank_raw_rows:sqlstring}}, toUInt64({RAW_ROWS_DEFAULT}))"
RANKS = f"toUInt64OrDefault(${{ranks:sqlstring}}, toUInt64({RANKS_DEFAULT}))"
COARSE_ROWS = f"toUInt64OrDefault(${{rank_coarse_rows:sqlstring}}, toUInt64({COARSE_ROWS_DEFAULT}))"
RAW_GATE = f"range_rows <= {RAW_ROWS}"
BUCKET_GATE = f"range_rows > {RAW_ROWS} AND range_rows <= {COARSE_ROWS}"
COARSE_GATE = f"range_rows > {RAW_ROWS} AND range_rows > {COARSE_ROWS}"


def _given_runs_when(gate: str) -> str:
    """A gate over `range_rows` as a view's parameter can take it: the scalar itself (a parameter cannot
    name the query's WITH alias; ClickHouse runs the same scalar subquery once)."""
    return gate.replace("range_rows", RANGE_ROWS)


def _rank_rows() -> str:
    """The per-rank rows of the range, in v_rank_buckets' columns plus `latency` (one step's latency):
    from the raw rows, one per step, when the range is short; from v_rank_buckets_of the chosen runs
    (`latency` NULL) when it is long (its check for buckets delivered twice reads those runs alone);
    from v_rank_buckets_coarse_of when it is longer still. Each gate is a constant once ClickHouse has
    run the scalar subquery, so a branch not taken reads no rows, and a view not taken is given no run, so
    its checks for rows delivered twice read none either (tests/test_rank_aggregates.py)."""
    raw = ["ts", "run_id", "node", "rank", "toUInt64(1) AS steps", f"{MEMORY} AS memory",
           "toFloat64(latency_ms) AS latency_max"]
    raw += [e for c in SUMMED for e in (f"toUInt64({c} IS NOT NULL) AS `{c}_n`", f"ifNull(toFloat64({c}), 0) AS `{c}_sum`")]
    buckets = ["ts", "run_id", "node", "rank", "steps", "memory", "latency_max"]
    buckets += [f"`{c}_{k}`" for c in SUMMED for k in ("n", "sum")]
    where = f"$__timeFilter(ts) AND {RUN_FILTER} AND {NODE_FILTER}"
    sep = ", "
    return f"""SELECT {sep.join(raw)}, toFloat64(latency_ms) AS latency
    FROM {view('steps')}
    WHERE {RAW_GATE} AND {where}
    UNION ALL
    SELECT {sep.join(buckets)}, CAST(NULL AS Nullable(Float64)) AS latency
    FROM {view_of_chosen_runs('rank_buckets', when=_given_runs_when(BUCKET_GATE))}
    WHERE {BUCKET_GATE} AND {where}
    UNION ALL
    SELECT {sep.join(buckets)}, CAST(NULL AS Nullable(Float64)) AS latency
    FROM {view_of_chosen_runs('rank_buckets_coarse', when=_given_runs_when(COARSE_GATE))}
    WHERE {COARSE_GATE} AND {where}"""


def _ratio(column: str, n: str = "_n", s: str = "_sum") -> str:
    """The mean of a summed column over the steps that have it."""
    return f"if(sum(`{column}{n}`) = 0, NULL, sum(`{column}{s}`) / sum(`{column}{n}`))"


# the ranks kept: farthest first from their run's mean (of the ranks' values over the range)
_FARTHEST = "abs(overall - avg(overall) OVER (PARTITION BY run_id)) DESC, run_id, node, rank"


def _per_worker(column: str | None, name: str) -> SQL:
    """One series per rank of the mean of a summed `column` per time bucket (None: the peak memory), for
    the `$ranks` ranks whose value over the whole range is farthest from their run's mean. One read of
    the rows: each rank's points are gathered into an array, the ranks ordered, then unrolled."""
    if column is None:
        point, parts, overall = "max(memory)", "", "max(v)"
    else:
        point, parts = _ratio(column), f", sum(`{column}_n`) AS part_n, sum(`{column}_sum`) AS part_sum"
        overall = "if(sum(part_n) = 0, NULL, sum(part_sum) / sum(part_n))"
    return SQL(
        f"""WITH {RANGE_ROWS} AS range_rows
SELECT
    point.1 AS time,
    {WORKER} AS worker,
    point.2 AS `{name}`
FROM
(
    SELECT run_id, node, rank, groupArray((time, v)) AS points, {overall} AS overall
    FROM
    (
        SELECT $__timeInterval(ts) AS time, run_id, node, rank, {point} AS v{parts}
        FROM ({_rank_rows()})
        GROUP BY time, run_id, node, rank
    )
    GROUP BY run_id, node, rank
    ORDER BY {_FARTHEST}
    LIMIT {RANKS}
)
ARRAY JOIN points AS point
ORDER BY time""",
        expects=("time", "worker", name),
        format=TS,
    )


# From the per-step aggregates (v_step_means): each step's rank mean and slowest rank, per time bucket.
LATENCY_QUANTILES = SQL(
    f"""SELECT
    $__timeInterval(ts) AS time,
    run_id,
    avg(latency_ms) AS mean,
    quantile(0.95)(latency_ms_max) AS `p95 slowest rank`,
    max(latency_ms_max) AS max
FROM {STEP_MEANS}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND latency_ms IS NOT NULL
GROUP BY time, run_id
ORDER BY time""",
    expects=("time", "run_id", "mean", "p95 slowest rank", "max"),
    format=TS,
)

# One line per rank, the slowest (highest mean step latency) first, at most `$ranks`. The p95 step (exact,
# numpy.percentile's linear rule) needs every step's latency: shown while the range is short (raw rows),
# empty (NULL) when the range reads the aggregates, which keep no quantile state.
WORKERS = SQL(
    f"""WITH {RANGE_ROWS} AS range_rows
SELECT
    run_id,
    node,
    rank,
    sum(steps) AS steps,
    {_ratio('throughput')} AS `mean tokens/s`,
    {_ratio('latency_ms')} AS `mean step latency`,
    quantileExactInclusive(0.95)(latency) AS `p95 step latency`,
    max(latency_max) AS `max step latency`,
    max(memory) AS `peak memory`,
    max(ts) AS `last seen`
FROM ({_rank_rows()})
GROUP BY run_id, node, rank
ORDER BY `mean step latency` DESC, run_id, node, rank
LIMIT {RANKS}""",
    expects=("run_id", "node", "rank", "steps", "mean tokens/s", "mean step latency", "p95 step latency",
             "max step latency", "peak memory", "last seen"),
)


def _unit(name: str, unit: str) -> tuple[dashboard.MatcherConfig, list[dashboard.DynamicConfigValue]]:
    return dashboard.MatcherConfig(id_val="byName", options=name), [dashboard.DynamicConfigValue(id_val="unit", value=unit)]


def bounds() -> list[cogbuilder.Builder[dashboard.VariableModel]]:
    """The per-rank panels' three bounds: `ranks` (a text box), `rank_raw_rows` and `rank_coarse_rows` (hidden
    constants)."""
    ranks = str(RANKS_DEFAULT)
    return [
        dash_b.TextBoxVariable("ranks")
        .label("Ranks shown")
        .description("The most ranks a per-rank panel draws (those farthest from their run's mean first) and "
                     "'Nodes and ranks' lists (the slowest first).")
        .default_value(ranks)
        .current(dashboard.VariableOption(selected=True, text=ranks, value=ranks)),
        dash_b.ConstantVariable("rank_raw_rows")
        .description("Per-rank panels read one row per step while the chosen runs hold at most this many step "
                     "rows in the time range, else the per-rank aggregates (64 steps to a row).")
        .value(str(RAW_ROWS_DEFAULT)),
        dash_b.ConstantVariable("rank_coarse_rows")
        .description("Per-rank panels read the coarse per-rank aggregates (512 steps to a row) when the chosen runs "
                     "hold more than this many step rows in the time range.")
        .value(str(COARSE_ROWS_DEFAULT)),
    ]


def build() -> dash_b.Dashboard:
    board = base(
        UID,
        "AReaL · Efficiency",
        "Throughput, step latency and memory of every node and rank.",
        ["efficiency"],
    )
    for var in bounds():
        board = board.with_variable(var)
    per_worker = "${__field.labels.worker}"
    panels = [
        timeseries(
            "Throughput per node and rank",
            "Tokens per second each rank reported for its steps.",
            [_per_worker("throughput", "tokens/s")],
            unit="suffix: tok/s",
            calcs=["mean", "lastNotNull"],
            axis_label="tokens/s",
        ).display_name(per_worker),
        timeseries(
            "Total throughput per run",
            "Tokens per second of all ranks of a run together (tokens summed per time bucket).",
            [
                SQL(
                    f"""SELECT $__timeInterval(ts) AS time, run_id, sum(tokens_sum) / $__interval_s AS `tokens/s`
FROM {STEP_MEANS}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
GROUP BY time, run_id
ORDER BY time""",
                    expects=("time", "run_id", "tokens/s"),
                    format=TS,
                )
            ],
            unit="suffix: tok/s",
            calcs=["mean", "max"],
            axis_label="tokens/s",
        ).display_name("${__field.labels.run_id}"),
        timeseries(
            "Step latency per node and rank",
            "Wall time of one training step on each rank.",
            [_per_worker("latency_ms", "step latency")],
            unit="ms",
            calcs=["mean", "max"],
            axis_label="latency",
        ).display_name(per_worker),
        timeseries(
            "Step latency per run",
            "Per time bucket: the mean over steps of the ranks' mean step latency, the 95th percentile of the "
            "slowest rank's latency, and the slowest rank's maximum.",
            [LATENCY_QUANTILES],
            unit="ms",
            axis_label="latency",
        ).display_name("${__field.labels.run_id} ${__field.name}"),
        timeseries(
            "Memory per node and rank",
            "Accelerator memory in use at the end of each step; on a host without a GPU, the process's resident memory.",
            [_per_worker(None, "memory")],
            unit="bytes",
            calcs=["max", "lastNotNull"],
            axis_label="memory",
        ).display_name(per_worker),
        timeseries(
            "Tokens per step per node and rank",
            "Tokens each rank processed in one step (prompt and response).",
            [_per_worker("tokens", "tokens per step")],
            unit="none",
            axis_label="tokens per step",
        ).display_name(per_worker),
    ]
    for panel in panels:
        board = board.with_panel(panel)
    workers = table("Nodes and ranks", "One line per rank, the slowest first (at most $ranks): steps, mean throughput, "
                    "mean, p95 and slowest step latency, peak memory. The p95 needs every step: it is empty when the "
                    "range holds more than $rank_raw_rows step rows.", WORKERS, height=8)
    for name, unit in (
        ("mean tokens/s", "suffix: tok/s"),
        ("mean step latency", "ms"),
        ("p95 step latency", "ms"),
        ("max step latency", "ms"),
        ("peak memory", "bytes"),
        ("last seen", "dateTimeAsIso"),
    ):
        workers = workers.with_override(*_unit(name, unit))
    return board.with_panel(workers)
