"""Efficiency: throughput (tokens/s), step latency and memory per node and rank."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.models import dashboard

from areal_metrics.grafana.clickhouse import SQL, Format, view
from areal_metrics.grafana.panels import NODE_FILTER, RUN_FILTER, base, table, timeseries

UID = "areal-efficiency"
TS = Format.TIME_SERIES
WORKER = "concat(run_id, ' · ', node, ' · rank ', toString(rank))"
# Per-rank panels read the per-rank aggregates kept at insert time (v_rank_buckets: one row per run,
# node, rank and 64 steps, exactly the deduplicated raw rows' sums): a point is placed at its
# bucket's last step, and the time range keeps the buckets whose last step falls in it.
RANK_BUCKETS = view("rank_buckets")


def _ratio(column: str) -> str:
    """The mean of a summed column over the steps that have it."""
    return f"if(sum({column}_n) = 0, NULL, sum({column}_sum) / sum({column}_n))"


def _per_worker(value: str, name: str) -> SQL:
    # grouped by the columns the label is made of: the label is built once per group, not per row
    return SQL(
        f"""SELECT
    $__timeInterval(ts) AS time,
    {WORKER} AS worker,
    {value} AS `{name}`
FROM {RANK_BUCKETS}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND {NODE_FILTER}
GROUP BY time, run_id, node, rank
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
FROM {view('step_means')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND latency_ms IS NOT NULL
GROUP BY time, run_id
ORDER BY time""",
    expects=("time", "run_id", "mean", "p95 slowest rank", "max"),
    format=TS,
)

WORKERS = SQL(
    f"""SELECT
    run_id,
    node,
    rank,
    sum(steps) AS steps,
    {_ratio('throughput')} AS `mean tokens/s`,
    {_ratio('latency_ms')} AS `mean step latency`,
    max(latency_max) AS `max step latency`,
    max(memory) AS `peak memory`,
    max(ts) AS `last seen`
FROM {RANK_BUCKETS}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND {NODE_FILTER}
GROUP BY run_id, node, rank
ORDER BY run_id, node, rank""",
    expects=("run_id", "node", "rank", "steps", "mean tokens/s", "mean step latency", "max step latency", "peak memory",
             "last seen"),
)


def _unit(name: str, unit: str) -> tuple[dashboard.MatcherConfig, list[dashboard.DynamicConfigValue]]:
    return dashboard.MatcherConfig(id_val="byName", options=name), [dashboard.DynamicConfigValue(id_val="unit", value=unit)]


def build() -> dash_b.Dashboard:
    board = base(
        UID,
        "AReaL · Efficiency",
        "Throughput, step latency and memory of every node and rank.",
        ["efficiency"],
    )
    per_worker = "${__field.labels.worker}"
    panels = [
        timeseries(
            "Throughput per node and rank",
            "Tokens per second each rank reported for its steps.",
            [_per_worker(_ratio("throughput"), "tokens/s")],
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
FROM {view('step_means')}
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
            [_per_worker(_ratio("latency_ms"), "step latency")],
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
            [_per_worker("max(memory)", "memory")],
            unit="bytes",
            calcs=["max", "lastNotNull"],
            axis_label="memory",
        ).display_name(per_worker),
        timeseries(
            "Tokens per step per node and rank",
            "Tokens each rank processed in one step (prompt and response).",
            [_per_worker(_ratio("tokens"), "tokens per step")],
            unit="none",
            axis_label="tokens per step",
        ).display_name(per_worker),
    ]
    for panel in panels:
        board = board.with_panel(panel)
    workers = table("Nodes and ranks", "One line per rank: steps, mean throughput, mean and slowest step latency, peak memory.", WORKERS, height=8)
    for name, unit in (
        ("mean tokens/s", "suffix: tok/s"),
        ("mean step latency", "ms"),
        ("max step latency", "ms"),
        ("peak memory", "bytes"),
        ("last seen", "dateTimeAsIso"),
    ):
        workers = workers.with_override(*_unit(name, unit))
    return board.with_panel(workers)
