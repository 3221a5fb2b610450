"""Evaluation: accuracy and response length per dataset over steps, consensus, degraded rounds.

The two-axis view (quality on the left axis, generation behaviour on the
right) is repeated once per selected dataset. Numbers are the cross-node
consensus of each round (topic areal.evals.consensus): for a step that has
both a quick and a full stage, the full stage wins. Stale rounds (degraded
mode: the last good result repeated) and partial rounds (timeout before all
replicas answered) are marked as annotations and flagged in the rounds table.
Every round carries its uncertainty: a band of its 95 % interval per run, and the
interval, decided and undecided samples in the rounds table. pass@K, maj@K and the
greedy accuracy of each round's consensus (`eval_consensus.metrics`) are drawn per
dataset beside it. The generations table (a fixed choice of prompts per dataset, the
same every round) has its own filters: step, verdict and error type.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.models import common, dashboard

from areal_metrics.grafana.clickhouse import SQL, Format, view
from areal_metrics.grafana.panels import (
    DATASET_FILTER,
    NODE_FILTER,
    RUN_FILTER,
    annotation,
    base,
    table,
    timeseries,
    trend,
    variable,
)

UID = "areal-evaluation"
TS = Format.TIME_SERIES

# the full stage of a round wins over its quick stage; the newest event breaks ties
BEST_STAGE = "(stage = 'full', ts)"

BY_STEP = SQL(
    f"""SELECT
    step,
    run_id,
    argMax(accuracy, {BEST_STAGE}) AS accuracy,
    argMax(response_length, {BEST_STAGE}) AS `response length`
FROM {view('eval_consensus')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND dataset IN (${{dataset:singlequote}})
GROUP BY step, run_id
ORDER BY step""",
    expects=("step", "run_id", "accuracy", "response length"),
)


# One run's accuracy with its 95 % interval by step (the full stage wins, as above): the
# band fills from `95% high` down to `95% low`. Grafana fills to the first field of that
# name, so the panel repeats per run and is exact for one dataset at a time.
BAND_LOW, BAND_HIGH = "95% low", "95% high"
INTERVAL_BY_STEP = SQL(
    f"""SELECT
    step,
    dataset,
    argMax(accuracy, {BEST_STAGE}) AS accuracy,
    argMax(ci_low, {BEST_STAGE}) AS `{BAND_LOW}`,
    argMax(ci_high, {BEST_STAGE}) AS `{BAND_HIGH}`
FROM {view('eval_consensus')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND dataset IN (${{dataset:singlequote}}) AND NOT stale
  AND ci_low IS NOT NULL
GROUP BY step, dataset
ORDER BY step""",
    expects=("step", "dataset", "accuracy", BAND_LOW, BAND_HIGH),
)


# pass@K, maj@K and greedy accuracy of each round's consensus, one series per run and metric
CONSENSUS_METRICS_BY_STEP = SQL(
    f"""SELECT
    step,
    concat(run_id, ' · ', name) AS series,
    argMax(value, {BEST_STAGE}) AS value
FROM {view('eval_consensus')}
ARRAY JOIN mapKeys(metrics) AS name, mapValues(metrics) AS value
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND dataset IN (${{dataset:singlequote}}) AND NOT stale
GROUP BY step, series
ORDER BY step""",
    expects=("step", "series", "value"),
)


def _consensus_series(value: str, name: str) -> SQL:
    return SQL(
        f"""SELECT
    ts AS time,
    concat(run_id, ' · ', dataset, ' · ', stage) AS series,
    {value} AS `{name}`
FROM {view('eval_consensus')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND {DATASET_FILTER}
ORDER BY time""",
        expects=("time", "series", name),
        format=TS,
    )


DEGRADED_MARKERS_SQL = f"""SELECT
    ts AS time,
    concat(if(stale, 'stale', 'partial'), ' round: ', dataset, ' ', stage, ' at step ', toString(step)) AS title,
    concat(toString(votes), '/', toString(replicas), ' replicas answered, accuracy ', toString(round(accuracy, 3)),
           if(stale, ' (repeats the last good result)', ' (timed out)')) AS text,
    concat('eval,', if(stale, 'stale', 'partial'), ',', dataset) AS tags
FROM {view('eval_consensus')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND (stale OR partial)
ORDER BY time"""

# The commands the trainers applied (their `command_ack` events), marked where they took effect: a
# `scale_lr` the worker decided on an evaluation shows on the accuracy-over-time panel beside that round.
APPLIED_COMMAND_MARKERS_SQL = f"""SELECT
    ts AS time,
    concat('applied ', command, ' @', node) AS title,
    concat(command, ' from step ', ifNull(toString(step), '?'), ', lr factor ', ifNull(toString(round(lr_factor, 4)), '-'),
           if(detail = '', '', concat(' (', detail, ')'))) AS text,
    concat('command,applied,', command) AS tags
FROM {view('command_acks')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND status = 'applied'
ORDER BY time"""

ROUNDS = SQL(
    f"""SELECT
    ts AS time,
    run_id,
    step,
    dataset,
    stage,
    accuracy,
    response_length AS `response length`,
    concat('[', toString(round(ci_low, 3)), ', ', toString(round(ci_high, 3)), ']') AS `95% interval`,
    n_samples AS samples,
    n_undecided AS undecided,
    agreement,
    concat(toString(votes), '/', toString(replicas)) AS votes,
    arrayStringConcat(dissenters, ', ') AS dissenters,
    multiIf(stale, 'stale', partial, 'partial', 'ok') AS state
FROM {view('eval_consensus')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND {DATASET_FILTER}
ORDER BY time DESC
LIMIT 200""",
    expects=("time", "run_id", "step", "dataset", "stage", "accuracy", "response length", "95% interval", "samples",
             "undecided", "agreement", "votes", "dissenters", "state"),
)

NODE_RESULTS = SQL(
    f"""SELECT
    ts AS time,
    run_id,
    step,
    dataset,
    stage,
    node,
    status,
    accuracy,
    response_length AS `response length`,
    latency_ms AS latency,
    ifNull(error, '') AS error
FROM {view('evals')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND {NODE_FILTER} AND {DATASET_FILTER}
ORDER BY time DESC
LIMIT 200""",
    expects=("time", "run_id", "step", "dataset", "stage", "node", "status", "accuracy", "response length",
             "latency", "error"),
)

# The generations table's own filters (after the shared ones): a sample's verdict as the table shows
# it, and its error type ('none' for a right answer or a producer that sent none).
VERDICT = "multiIf(verdict = 1, 'right', verdict = 0, 'wrong', 'none')"
ERROR_TYPE = "if(error_type = '', 'none', error_type)"
GENERATION_FILTERS = (
    "$__conditionalAll(toString(step) IN (${gen_step:singlequote}), $gen_step)",
    f"$__conditionalAll({VERDICT} IN (${{verdict:singlequote}}), $verdict)",
    f"$__conditionalAll({ERROR_TYPE} IN (${{error_type:singlequote}}), $error_type)",
)
_GENERATIONS_OF_RUNS = f"FROM {view('generations')} WHERE $__timeFilter(ts) AND {RUN_FILTER} AND {DATASET_FILTER}"


def generation_variables() -> list[dash_b.QueryVariable]:
    """Step, verdict and error type of the generations table (multi, with All)."""
    return [
        variable("gen_step", "Step", f"SELECT DISTINCT toString(step) AS s {_GENERATIONS_OF_RUNS} "
                 "ORDER BY toUInt64(s) DESC", include_all=True,
                 description="Steps of the generations table (the same prompts every round: compare two steps)."),
        variable("verdict", "Verdict", f"SELECT DISTINCT {VERDICT} AS v {_GENERATIONS_OF_RUNS} ORDER BY v",
                 include_all=True, description="right or wrong samples of the generations table."),
        variable("error_type", "Error type", f"SELECT DISTINCT {ERROR_TYPE} AS e {_GENERATIONS_OF_RUNS} ORDER BY e != 'none', e",
                 include_all=True, description="Error types of the generations table (none: a right answer)."),
    ]


# the samples of each node's results (log_eval(samples=[...])), as W&B users see sample tables
GENERATIONS = SQL(
    f"""SELECT
    ts AS time,
    run_id,
    step,
    dataset,
    stage,
    node,
    sample,
    verdict,
    {ERROR_TYPE} AS `error type`,
    gold,
    reward,
    prompt,
    response
FROM {view('generations')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND {NODE_FILTER} AND {DATASET_FILTER}
  AND {' AND '.join(GENERATION_FILTERS)}
ORDER BY step DESC, dataset, stage, prompt, node, sample
LIMIT 500""",
    expects=("time", "run_id", "step", "dataset", "stage", "node", "sample", "verdict", "error type", "gold",
             "reward", "prompt", "response"),
)

SERIES = "${__field.labels.series}"


def _by_name(name: str) -> dashboard.MatcherConfig:
    return dashboard.MatcherConfig(id_val="byName", options=name)


def _prop(key: str, value: object) -> dashboard.DynamicConfigValue:
    return dashboard.DynamicConfigValue(id_val=key, value=value)


def build() -> dash_b.Dashboard:
    board = base(
        UID,
        "AReaL · Evaluation",
        "Evaluation rounds: consensus accuracy and response length per dataset over training steps, agreement "
        "between nodes, degraded (stale) and partial rounds.",
        ["evaluation"],
    )
    board = board.annotation(annotation("Stale / partial rounds", "#FF9830", DEGRADED_MARKERS_SQL))
    board = board.annotation(annotation("Commands applied", "#5794F2", APPLIED_COMMAND_MARKERS_SQL))
    for var in generation_variables():
        board = board.with_variable(var)

    two_axis = (
        trend(
            "Accuracy and response length by step · $dataset",
            "Quality (accuracy, left axis) and generation behaviour (mean response length in tokens, right axis) "
            "of each evaluation round's consensus, one line pair per run.",
            BY_STEP,
            x_field="step",
            unit="percentunit",
            partition_by="run_id",
            width=12,
            height=9,
            axis_label="accuracy",
        )
        .min(0)
        .repeat("dataset")
        .repeat_direction("h")
        .max_per_row(2)
        .with_override(
            _by_name("response length"),
            [
                _prop("unit", "suffix: tokens"),
                _prop("min", 0),
                _prop("custom.axisPlacement", common.AxisPlacement.RIGHT),
                _prop("custom.axisLabel", "response length (tokens)"),
                _prop("custom.lineStyle", {"fill": "dash", "dash": [10, 10]}),
            ],
        )
        .with_override(_by_name("accuracy"), [_prop("max", 1)])
    )
    board = board.with_panel(two_axis)
    hidden = _prop("custom.hideFrom", {"legend": True, "tooltip": False, "viz": False})
    band = (
        trend(
            "Accuracy with its 95% interval · $run",
            "Consensus accuracy of each round (full stage where a step has both) and its 95% interval as a band: "
            "Clopper-Pearson on the effective sample size (wider when several samples share a prompt), over "
            "every sample of the round: its undecided samples counted wrong at the low end and right at the high "
            "end. A round whose band "
            "reaches over the loop's threshold is no evidence of a drop. Pick one dataset for an exact band.",
            INTERVAL_BY_STEP,
            x_field="step",
            unit="percentunit",
            partition_by="dataset",
            width=12,
            height=9,
            axis_label="accuracy",
        )
        .min(0)
        .max(1)
        .repeat("run")
        .repeat_direction("h")
        .max_per_row(2)
        .with_override(_by_name(BAND_HIGH), [_prop("custom.fillBelowTo", BAND_LOW), _prop("custom.lineWidth", 0),
                                             _prop("custom.fillOpacity", 20), _prop("custom.showPoints", "never"),
                                             hidden])
        .with_override(_by_name(BAND_LOW), [_prop("custom.lineWidth", 0), _prop("custom.showPoints", "never"),
                                            hidden])
    )
    board = board.with_panel(band)
    board = board.with_panel(
        trend(
            "pass@k, maj@k and greedy accuracy by step · $dataset",
            "Of each round's consensus (eval_consensus.metrics; the full stage where a step has both): pass@k, "
            "a prompt passes when one of its k samples is right, voted per sample across nodes; maj@k, the most "
            "frequent of the k answers is right; greedy accuracy, the argmax answer is right. maj@k and greedy "
            "are the agreeing nodes' means weighted by their sample counts.",
            CONSENSUS_METRICS_BY_STEP,
            x_field="step",
            unit="percentunit",
            partition_by="series",
            width=12,
            height=9,
            axis_label="share of prompts",
        )
        .min(0)
        .max(1)
        .repeat("dataset")
        .repeat_direction("h")
        .max_per_row(2)
    )

    panels = [
        timeseries(
            "Accuracy per dataset",
            "Consensus accuracy of every round, per run, dataset and stage.",
            [_consensus_series("accuracy", "accuracy")],
            unit="percentunit",
            calcs=["lastNotNull", "max"],
            axis_label="accuracy",
        )
        .min(0)
        .max(1)
        .display_name(SERIES),
        timeseries(
            "Response length per dataset",
            "Consensus mean response length of every round, in tokens.",
            [_consensus_series("response_length", "response length")],
            unit="suffix: tokens",
            axis_label="tokens",
        ).display_name(SERIES),
        timeseries(
            "Consensus agreement",
            "Share of samples (or values) on the majority side of the vote between nodes; below 100% some node "
            "disagreed.",
            [_consensus_series("agreement", "agreement")],
            unit="percentunit",
            axis_label="agreement",
        )
        .min(0)
        .max(1)
        .display_name(SERIES),
        timeseries(
            "Evaluation latency per node",
            "Wall time of each node's evaluation of one dataset and stage.",
            [
                SQL(
                    f"""SELECT ts AS time, concat(run_id, ' · ', node, ' · ', dataset) AS series, latency_ms AS latency
FROM {view('evals')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND {NODE_FILTER} AND {DATASET_FILTER} AND latency_ms IS NOT NULL
ORDER BY time""",
                    expects=("time", "series", "latency"),
                    format=TS,
                )
            ],
            unit="ms",
            axis_label="latency",
        ).display_name(SERIES),
    ]
    for panel in panels:
        board = board.with_panel(panel)

    board = board.with_panel(
        table(
            "Evaluation rounds (consensus)",
            "Newest first. state: ok, stale (degraded mode repeated the last good result) or partial (emitted at "
            "the timeout before every replica answered).",
            ROUNDS,
        )
        .with_override(_by_name("accuracy"), [_prop("unit", "percentunit")])
        .with_override(_by_name("agreement"), [_prop("unit", "percentunit")])
        .with_override(
            _by_name("state"),
            [
                _prop("custom.cellOptions", {"type": "color-background"}),
                _prop(
                    "mappings",
                    [
                        {
                            "type": "value",
                            "options": {
                                "ok": {"color": "green", "index": 0},
                                "stale": {"color": "orange", "index": 1},
                                "partial": {"color": "yellow", "index": 2},
                            },
                        }
                    ],
                ),
            ],
        )
    )
    board = board.with_panel(
        table(
            "Results per node",
            "Each node's own result of each round and dataset (failed rounds show the error).",
            NODE_RESULTS,
        )
        .with_override(_by_name("accuracy"), [_prop("unit", "percentunit")])
        .with_override(_by_name("latency"), [_prop("unit", "ms")])
    )
    board = board.with_panel(
        table(
            "Generations",
            "The samples behind each node's result, newest step first: the first sample of a fixed choice of "
            "prompts per dataset (the same every round), its verdict, error type, gold answer, reward and "
            "response (text cut at the documented size, docs/CONTRACT.md). Filter by step, verdict and error "
            "type above.",
            GENERATIONS,
            height=12,
        ).with_override(
            _by_name("verdict"),
            [
                _prop("custom.cellOptions", {"type": "color-text"}),
                _prop("mappings", [{"type": "value", "options": {
                    "1": {"color": "green", "text": "right", "index": 0},
                    "0": {"color": "red", "text": "wrong", "index": 1}}}]),
            ],
        )
    )
    return board
