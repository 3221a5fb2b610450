"""Alerts and commands: recent alerts with the commands they caused, commands, dead letters.

An alert and a command are linked when the command's `args` name the alert
(`alert_id`), or else when the command was issued for the same run within
CAUSE_WINDOW_S seconds after the alert: the stream worker reacts to what it
alerts on at once, so a command shortly after an alert is its consequence.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.models import common, dashboard

from areal_metrics.grafana.clickhouse import SQL, Format, view
from areal_metrics.grafana.panels import RUN_FILTER, base, table, timeseries

UID = "areal-alerts"
CAUSE_WINDOW_S = 30

ALERTS_WITH_COMMANDS = SQL(
    f"""SELECT
    a.ts AS time,
    a.run_id AS run_id,
    a.node AS node,
    a.severity AS severity,
    a.kind AS kind,
    a.message AS message,
    a.step AS step,
    a.value AS value,
    a.threshold AS threshold,
    arrayStringConcat(
        arrayMap(c -> concat(c.1, ' ', c.2, if(c.4 = '', '', concat(' @', c.4))),
                 arrayFilter(c -> JSONExtractString(c.2, 'alert_id') = a.alert_id
                                  OR (c.3 >= a.ts AND c.3 <= a.ts + INTERVAL {CAUSE_WINDOW_S} SECOND),
                             c.cmds)),
        '; ') AS `commands caused`
FROM
(
    SELECT ts, run_id, node, severity, kind, message, step, value, threshold, alert_id
    FROM {view('alerts')}
    WHERE $__timeFilter(ts) AND {RUN_FILTER}
) AS a
LEFT JOIN
(
    SELECT run_id, groupArray((command, args, ts, ifNull(target_node, ''))) AS cmds
    FROM {view('commands')}
    WHERE ts >= $__fromTime AND {RUN_FILTER}
    GROUP BY run_id
) AS c ON c.run_id = a.run_id
ORDER BY time DESC
LIMIT 200""",
    expects=("time", "run_id", "node", "severity", "kind", "message", "step", "value", "threshold", "commands caused"),
)

ALERTS_OVER_TIME = SQL(
    f"""SELECT $__timeInterval(ts) AS time, concat(severity, ' · ', kind) AS kind, toFloat64(count()) AS alerts
FROM {view('alerts')}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
GROUP BY time, kind
ORDER BY time""",
    expects=("time", "kind", "alerts"),
    format=Format.TIME_SERIES,
)

COMMANDS = SQL(
    f"""SELECT
    ts AS time,
    run_id,
    node AS issuer,
    command,
    ifNull(target_node, 'all nodes') AS target,
    args,
    reason
FROM {view('commands')}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
ORDER BY time DESC
LIMIT 200""",
    expects=("time", "run_id", "issuer", "command", "target", "args", "reason"),
)

DEAD_LETTERS = SQL(
    f"""SELECT
    ts AS time,
    source_topic AS topic,
    reason,
    substring(raw, 1, 300) AS raw
FROM {view('deadletter')}
WHERE $__timeFilter(ts)
ORDER BY time DESC
LIMIT 200""",
    expects=("time", "topic", "reason", "raw"),
)


def _severity_colors() -> list[dashboard.DynamicConfigValue]:
    return [
        dashboard.DynamicConfigValue(id_val="custom.cellOptions", value={"type": "color-text"}),
        dashboard.DynamicConfigValue(
            id_val="mappings",
            value=[
                {
                    "type": "value",
                    "options": {
                        "info": {"color": "blue", "index": 0},
                        "warning": {"color": "orange", "index": 1},
                        "critical": {"color": "red", "index": 2},
                    },
                }
            ],
        ),
    ]


def build() -> dash_b.Dashboard:
    board = base(
        UID,
        "AReaL · Alerts and commands",
        "What the stream worker noticed and what it told the trainers to do; input that was rejected.",
        ["alerts"],
    )
    board = board.with_panel(
        table(
            "Recent alerts and the commands they caused",
            f"Newest first. A command counts as caused by an alert when it names the alert, or was issued for the "
            f"same run within {CAUSE_WINDOW_S} s after it.",
            ALERTS_WITH_COMMANDS,
            height=10,
        ).with_override(dashboard.MatcherConfig(id_val="byName", options="severity"), _severity_colors())
    )
    board = board.with_panel(
        timeseries(
            "Alerts over time",
            "Number of alerts per time bucket, by severity and kind.",
            [ALERTS_OVER_TIME],
            unit="none",
            width=24,
            height=7,
            axis_label="alerts",
        )
        .draw_style(common.GraphDrawStyle.BARS)
        .fill_opacity(60)
        .stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
        .display_name("${__field.labels.kind}")
    )
    board = board.with_panel(table("Commands", "Commands to the trainers, newest first.", COMMANDS, width=12, height=9))
    board = board.with_panel(
        table(
            "Dead-lettered input",
            "Events that failed validation, with the reason naming the field (topic areal.deadletter).",
            DEAD_LETTERS,
            width=12,
            height=9,
        )
    )
    return board
