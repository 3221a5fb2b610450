"""Training: reward (raw, sliding average, EMA), entropy, KL, advantages, clip ratio, lr.

Command markers (and warning/critical alerts) are dashboard annotations, so
every panel shows when the stream worker told the trainers to evaluate, change
the eval interval, scale the learning rate or stop.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash_b

from areal_metrics.grafana.clickhouse import SQL, Format, view
from areal_metrics.grafana.panels import (
    ALERT_MARKERS_SQL,
    COMMAND_MARKERS_SQL,
    RUN_FILTER,
    STEP_MEANS,
    annotation,
    base,
    stat,
    timeseries,
)

UID = "areal-training"
TS = Format.TIME_SERIES


# Per-step curves read the rank means kept at insert time (STEP_MEANS, v_step_means_of the chosen
# runs: one row per run and step, the sink's rule), never the raw rank rows: a panel's cost grows
# with steps, not ranks x steps; a long range is downsampled to the panel's width by $__timeInterval.


def _step_metric(*columns: str) -> SQL:
    """Per run and time bucket, the mean over the bucket's steps of step metrics' rank means: `expr AS name` pairs."""
    select = ",\n    ".join(columns)
    names = tuple(c.rsplit(" AS ", 1)[1].strip("`") for c in columns)
    sql = f"""SELECT
    $__timeInterval(ts) AS time,
    run_id,
    {select}
FROM {STEP_MEANS}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
GROUP BY time, run_id
ORDER BY time"""
    return SQL(sql, expects=("time", "run_id", *names), format=TS)


REWARD_SMOOTHED = SQL(
    f"""SELECT
    $__timeInterval(ts) AS time,
    run_id,
    avg(reward) AS `reward (raw)`,
    avg(sliding_avg) AS `sliding avg`,
    avg(ema) AS `EMA`
FROM {view('rewards_smoothed')}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
GROUP BY time, run_id
ORDER BY time""",
    expects=("time", "run_id", "reward (raw)", "sliding avg", "EMA"),
    format=TS,
)

LATEST_STEP = SQL(
    f"""SELECT $__timeInterval(ts) AS time, run_id, max(step) AS step
FROM {STEP_MEANS}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
GROUP BY time, run_id
ORDER BY time""",
    expects=("time", "run_id", "step"),
    format=TS,
)

LATEST_EMA = SQL(
    f"""SELECT $__timeInterval(ts) AS time, run_id, argMax(ema, step) AS `reward EMA`
FROM {view('rewards_smoothed')}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
GROUP BY time, run_id
ORDER BY time""",
    expects=("time", "run_id", "reward EMA"),
    format=TS,
)

RUN_THROUGHPUT = SQL(
    f"""SELECT $__timeInterval(ts) AS time, run_id, sum(tokens_sum) / $__interval_s AS `tokens/s`
FROM {STEP_MEANS}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
GROUP BY time, run_id
ORDER BY time""",
    expects=("time", "run_id", "tokens/s"),
    format=TS,
)

LATEST_ALERTS = SQL(
    f"""SELECT $__timeInterval(ts) AS time, run_id, toFloat64(count()) AS alerts
FROM {view('alerts')}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
GROUP BY time, run_id
ORDER BY time""",
    expects=("time", "run_id", "alerts"),
    format=TS,
)

# legend/tooltip names: "<run> <metric>"
BY_RUN = "${__field.labels.run_id} ${__field.name}"


def build() -> dash_b.Dashboard:
    board = base(
        UID,
        "AReaL · Training",
        "PPO/GRPO training metrics per run, the rank mean of each step (weighted by n_samples); markers show the commands the stream worker issued.",
        ["training"],
    )
    board = board.annotation(annotation("Commands", "#5794F2", COMMAND_MARKERS_SQL))
    board = board.annotation(annotation("Alerts", "#F2495C", ALERT_MARKERS_SQL))

    stats = [
        stat("Step", "Latest training step of each run.", LATEST_STEP, unit="none").display_name("${__field.labels.run_id}"),
        stat("Reward EMA", "Exponential moving average of the reward at the latest step.", LATEST_EMA, unit="none")
        .decimals(3)
        .display_name("${__field.labels.run_id}"),
        stat("Throughput", "Tokens processed per second, all ranks of a run together.", RUN_THROUGHPUT, unit="suffix: tok/s")
        .display_name("${__field.labels.run_id}"),
        stat("Alerts", "Alerts raised in the selected time range.", LATEST_ALERTS, unit="none")
        .display_name("${__field.labels.run_id}"),
    ]
    for panel in stats:
        board = board.with_panel(panel)

    panels = [
        timeseries(
            "Reward: raw, sliding average and EMA",
            "Reward per step as the trainers reported it, its sliding-window average and its exponential moving "
            "average (computed by the stream worker, topic areal.rewards.smoothed).",
            [REWARD_SMOOTHED],
            unit="none",
            calcs=["lastNotNull", "max"],
            axis_label="reward",
        ).display_name(BY_RUN),
        timeseries(
            "Policy entropy",
            "Mean token entropy of the policy; a fast fall means the policy is collapsing.",
            [_step_metric("avg(entropy) AS entropy")],
            unit="none",
            axis_label="entropy (nats)",
        ).display_name(BY_RUN),
        timeseries(
            "KL divergence to the reference policy",
            "Mean KL(policy || reference) per step.",
            [_step_metric("avg(kl) AS KL")],
            unit="none",
            axis_label="KL (nats)",
        ).display_name(BY_RUN),
        timeseries(
            "Advantages",
            "Mean and standard deviation of the (group-normalised) advantages.",
            [_step_metric("avg(advantage_mean) AS `advantage mean`", "avg(advantage_std) AS `advantage std`")],
            unit="none",
            axis_label="advantage",
        ).display_name(BY_RUN),
        timeseries(
            "Clip ratio",
            "Share of tokens whose probability ratio was clipped by the PPO objective.",
            [_step_metric("avg(clip_ratio) AS `clip ratio`")],
            unit="percentunit",
            axis_label="clipped tokens",
        ).display_name(BY_RUN),
        timeseries(
            "Learning rate",
            "Learning rate in use (changes when a scale_lr command was obeyed).",
            [_step_metric("avg(lr) AS lr")],
            unit="sci",
            axis_label="learning rate",
        ).display_name(BY_RUN),
        timeseries(
            "Loss and gradient norm",
            "Training loss and the gradient norm before clipping.",
            [_step_metric("avg(loss) AS loss", "avg(grad_norm) AS `grad norm`")],
            unit="none",
        ).display_name(BY_RUN),
        timeseries(
            "Response length (training rollouts)",
            "Mean length of the sampled responses, in tokens.",
            [_step_metric("avg(response_length) AS `response length`")],
            unit="suffix: tokens",
            axis_label="tokens",
        ).display_name(BY_RUN),
    ]
    for panel in panels:
        board = board.with_panel(panel)
    return board
