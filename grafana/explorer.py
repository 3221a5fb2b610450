"""Metrics explorer: every key a run logged in `metrics`, by training step, one line per run.

What a trainer logs beyond the typed columns (TRL's `rewards/<func>/mean`, verl's ~80
`actor/*`, `perf/*`, `timing_s/*`...) lands in the steps' `metrics` map. The `metric`
variable offers the keys the selected runs logged in the time range; one panel is drawn per
chosen key (the mean over a step's ranks, from the per-step aggregates `v_step_means`), and a
table gives each key's last step mean, min and max value per run.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash_b

from areal_metrics.grafana.clickhouse import SQL, view
from areal_metrics.grafana.panels import RUN_FILTER, STEP_MEANS, base, table, trend
from areal_metrics.grafana.panels import variable as query_variable

UID = "areal-explorer"

# Everything here reads the per-step aggregates (v_step_means: each key's mean over the step's
# ranks, its min, max and how many ranks logged it), never the raw rank rows.
METRIC_KEYS = f"""SELECT DISTINCT arrayJoin(mapKeys(metric_counts)) AS metric
FROM {STEP_MEANS}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
ORDER BY metric"""

# downsampled to the panel's width: a point per run and time bucket, at the bucket's mean step
BY_STEP = SQL(
    f"""SELECT
    avg(step) AS step,
    run_id,
    avg(metrics[${{metric:singlequote}}]) AS value
FROM {STEP_MEANS}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND mapContains(metrics, ${{metric:singlequote}})
GROUP BY $__timeInterval(ts), run_id
ORDER BY step""",
    expects=("step", "run_id", "value"),
)

SUMMARY = SQL(
    f"""SELECT
    key AS metric,
    run_id,
    argMax(metrics[key], step) AS last,
    min(metrics_min[key]) AS min,
    max(metrics_max[key]) AS max,
    sum(metric_counts[key]) AS points
FROM {STEP_MEANS}
ARRAY JOIN mapKeys(metric_counts) AS key
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND key IN (${{metric:singlequote}})
GROUP BY key, run_id
ORDER BY key, run_id""",
    expects=("metric", "run_id", "last", "min", "max", "points"),
)


def build() -> dash_b.Dashboard:
    board = base(
        UID,
        "AReaL · Metrics explorer",
        "Any value the runs logged beyond the typed columns (the steps' `metrics`), by step, one line per run.",
        ["explorer"],
    )
    board = board.with_variable(query_variable(
        "metric",
        "Metric",
        METRIC_KEYS,
        include_all=False,
        description="Keys of the chosen runs' metrics (what the trainer logged beyond the typed columns).",
    ))
    per_key = (
        trend(
            "$metric by step",
            "The key's mean over the ranks of each step, one line per run.",
            BY_STEP,
            x_field="step",
            unit="none",
            partition_by="run_id",
            width=12,
            height=8,
            axis_label="$metric",
        )
        .repeat("metric")
        .repeat_direction("h")
        .max_per_row(2)
    )
    board = board.with_panel(per_key)
    return board.with_panel(table("Chosen keys per run", "Each chosen key's last, minimum and maximum value per run.",
                                  SUMMARY, height=8))
