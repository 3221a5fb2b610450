"""Runs compared: reward curves of the chosen runs side by side, by training step.

Runs happen at different times, so the curves are drawn against the step
(Grafana's trend panel, x = step), one line per run: pick for example a run
with group size 4 and one with group size 2 in the `run` variable. The run
lifecycle (status, attempts, group, tags) and the configs side by side come
from `v_runs`, one row per run folded from its `run` events.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.models import dashboard

from areal_metrics.grafana.clickhouse import SQL, Format, stored, view
from areal_metrics.grafana.panels import DATASET_FILTER, RUN_FILTER, STEP_MEANS, base, table, timeseries, trend

UID = "areal-runs"

# The step's rank mean (v_step_means), downsampled to the panel's width: one point per run and
# time bucket, at the bucket's mean step (a run's steps rise with time).
RAW_BY_STEP = SQL(
    f"""SELECT avg(step) AS step, run_id, avg(reward) AS reward
FROM {STEP_MEANS}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
GROUP BY $__timeInterval(ts), run_id
ORDER BY step""",
    expects=("step", "run_id", "reward"),
)

EMA_BY_STEP = SQL(
    f"""SELECT step, run_id, argMax(ema, ts) AS `reward EMA`
FROM {view('rewards_smoothed')}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
GROUP BY step, run_id
ORDER BY step""",
    expects=("step", "run_id", "reward EMA"),
)

ACCURACY_BY_STEP = SQL(
    f"""SELECT step, concat(run_id, ' · ', dataset) AS series, argMax(accuracy, (stage = 'full', ts)) AS accuracy
FROM {view('eval_consensus')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND {DATASET_FILTER}
GROUP BY step, series
ORDER BY step""",
    expects=("step", "series", "accuracy"),
)

THROUGHPUT = SQL(
    f"""SELECT $__timeInterval(ts) AS time, run_id, sum(tokens_sum) / $__interval_s AS `tokens/s`
FROM {STEP_MEANS}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
GROUP BY time, run_id
ORDER BY time""",
    expects=("time", "run_id", "tokens/s"),
    format=Format.TIME_SERIES,
)

SUMMARY = SQL(
    f"""SELECT
    s.run_id AS run_id,
    h.nodes AS nodes,
    s.ranks AS ranks,
    s.last_step AS `last step`,
    s.started AS started,
    s.duration_s AS duration,
    s.mean_throughput AS `tokens/s per rank`,
    r.last_ema AS `reward EMA`,
    r.best_avg AS `best sliding avg`,
    e.last_accuracy AS `last accuracy`
FROM
(
    SELECT run_id, max(ranks) AS ranks, max(step) AS last_step,
           min(first_ts) AS started, dateDiff('second', min(first_ts), max(ts)) AS duration_s,
           avg(throughput) AS mean_throughput
    FROM {STEP_MEANS}
    WHERE $__timeFilter(ts) AND {RUN_FILTER}
    GROUP BY run_id
) AS s
LEFT JOIN
(
    SELECT run_id, uniqExact(node) AS nodes FROM {stored('runs')} WHERE {RUN_FILTER} GROUP BY run_id
) AS h ON h.run_id = s.run_id
LEFT JOIN
(
    SELECT run_id, argMax(ema, step) AS last_ema, max(sliding_avg) AS best_avg
    FROM {view('rewards_smoothed')}
    WHERE $__timeFilter(ts) AND {RUN_FILTER}
    GROUP BY run_id
) AS r ON r.run_id = s.run_id
LEFT JOIN
(
    SELECT run_id, avg(acc) AS last_accuracy
    FROM
    (
        SELECT run_id, dataset, argMax(accuracy, (step, stage = 'full', ts)) AS acc
        FROM {view('eval_consensus')}
        WHERE $__timeFilter(ts) AND {RUN_FILTER} AND {DATASET_FILTER}
        GROUP BY run_id, dataset
    )
    GROUP BY run_id
) AS e ON e.run_id = s.run_id
ORDER BY started DESC""",
    expects=("run_id", "nodes", "ranks", "last step", "started", "duration", "tokens/s per rank", "reward EMA",
             "best sliding avg", "last accuracy"),
)


LIFECYCLE = SQL(
    f"""SELECT
    run_id,
    status,
    attempt,
    attempts,
    ifNull(`group`, '') AS `group`,
    arrayStringConcat(tags, ', ') AS tags,
    world_size AS `world size`,
    ranks AS `ranks reported`,
    ifNull(framework, '') AS framework,
    ifNull(git_commit, '') AS `git commit`,
    started,
    ended,
    dateDiff('second', started, ifNull(ended, now64(3))) AS duration,
    exit_code AS `exit code`
FROM {view('runs')}
WHERE {RUN_FILTER}
ORDER BY started DESC""",
    expects=("run_id", "status", "attempt", "attempts", "group", "tags", "world size", "ranks reported", "framework",
             "git commit", "started", "ended", "duration", "exit code"),
)

# one row per (config key, run): Grafana's "grouping to matrix" puts the runs side by side
CONFIG = SQL(
    f"""SELECT kv.1 AS key, run_id, kv.2 AS value
FROM {view('runs')}
ARRAY JOIN JSONExtractKeysAndValuesRaw(config) AS kv
WHERE {RUN_FILTER}
ORDER BY key, run_id""",
    expects=("key", "run_id", "value"),
)

STATUS_COLORS = {"running": "blue", "finished": "green", "failed": "red", "killed": "orange"}


def _unit(name: str, unit: str) -> tuple[dashboard.MatcherConfig, list[dashboard.DynamicConfigValue]]:
    return dashboard.MatcherConfig(id_val="byName", options=name), [dashboard.DynamicConfigValue(id_val="unit", value=unit)]


def build() -> dash_b.Dashboard:
    board = base(
        UID,
        "AReaL · Runs compared",
        "Reward and evaluation curves of several runs side by side, by training step (choose the runs in 'Run').",
        ["comparison"],
    )
    board = board.with_panel(
        trend(
            "Reward by step (raw)",
            "Mean reward over ranks at each step, one line per run.",
            RAW_BY_STEP,
            x_field="step",
            unit="none",
            partition_by="run_id",
            axis_label="reward",
        )
    )
    board = board.with_panel(
        trend(
            "Reward by step (EMA)",
            "Exponential moving average of the reward (stream worker), one line per run.",
            EMA_BY_STEP,
            x_field="step",
            unit="none",
            partition_by="run_id",
            axis_label="reward EMA",
        )
    )
    board = board.with_panel(
        trend(
            "Evaluation accuracy by step",
            "Consensus accuracy per run and dataset (full stage where there is one).",
            ACCURACY_BY_STEP,
            x_field="step",
            unit="percentunit",
            partition_by="series",
            axis_label="accuracy",
        )
        .min(0)
        .max(1)
    )
    board = board.with_panel(
        timeseries(
            "Throughput per run",
            "Tokens per second, all nodes and ranks of a run together.",
            [THROUGHPUT],
            unit="suffix: tok/s",
            axis_label="tokens/s",
        ).display_name("${__field.labels.run_id}")
    )
    summary = table("Runs", "One line per run: size, progress, reward and accuracy.", SUMMARY, height=7)
    for name, unit in (
        ("duration", "s"),
        ("tokens/s per rank", "suffix: tok/s"),
        ("last accuracy", "percentunit"),
        ("started", "dateTimeAsIso"),
    ):
        summary = summary.with_override(*_unit(name, unit))
    board = board.with_panel(summary)
    lifecycle = table("Run lifecycle", "One line per run from its run events: the latest attempt's status "
                      "(running, finished, failed, killed), attempts, group, tags, size and code version.",
                      LIFECYCLE, height=7)
    for name, unit in (("duration", "s"), ("started", "dateTimeAsIso"), ("ended", "dateTimeAsIso")):
        lifecycle = lifecycle.with_override(*_unit(name, unit))
    lifecycle = lifecycle.with_override(
        dashboard.MatcherConfig(id_val="byName", options="status"),
        [dashboard.DynamicConfigValue(id_val="custom.cellOptions", value={"type": "color-background"}),
         dashboard.DynamicConfigValue(id_val="mappings", value=[{"type": "value", "options": {
             status: {"color": color, "index": i} for i, (status, color) in enumerate(STATUS_COLORS.items())}}])])
    board = board.with_panel(lifecycle)
    config = table("Config side by side", "The config each chosen run logged (init(config=...)), one column per run.",
                   CONFIG, height=10).with_transformation(dashboard.DataTransformerConfig(
                       id_val="groupingToMatrix", options={"columnField": "run_id", "rowField": "key", "valueField": "value"}))
    return board.with_panel(config)
