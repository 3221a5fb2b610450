"""Small, typed helpers over the foundation SDK builders: the house style of our panels.

Every panel reads the fixed ClickHouse datasource (uid `areal-clickhouse`),
every query is raw SQL against deduplicated data (the `v_*` views of
`areal_metrics.sinks.views`, in `areal_metrics.grafana.clickhouse.DATABASE`), filtered by the
dashboard's time range and the `run` / `node` / `dataset` variables; `group`
and `tag` narrow the runs `run` offers.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import table as table_b
from grafana_foundation_sdk.builders import timeseries as ts_b
from grafana_foundation_sdk.builders import trend as trend_b
from grafana_foundation_sdk.models import common, dashboard

from areal_metrics.grafana.clickhouse import (
    SQL,
    AnnotationTarget,
    Format,
    datasource_ref,
    stored,
    view,
    view_of_chosen_runs,
)
from areal_metrics.grafana.macros import ALL

REFRESH = "5s"
REFRESH_CHOICES = ["5s", "10s", "30s", "1m", "5m"]
DEFAULT_RANGE = ("now-30m", "now")

# Filters shared by every panel; `$__conditionalAll` drops a filter when "All" is selected.
RUN_FILTER = "run_id IN (${run:singlequote})"
NODE_FILTER = "$__conditionalAll(node IN (${node:singlequote}), $node)"
DATASET_FILTER = "$__conditionalAll(dataset IN (${dataset:singlequote}), $dataset)"
# The per-step means (one row per run and step, kept at insert time) of the chosen runs: v_step_means_of,
# whose check for steps delivered twice reads those runs alone (v_step_means' reads every run's).
STEP_MEANS = view_of_chosen_runs("step_means")


# ------------------------------------------------------------------ variables


# Runs from v_runs (one row per run: its `run` events), filtered by group and tag; a run
# that sent no run events (a producer other than the client) is listed while no group or
# tag is chosen.
RUN_PICKER = f"""SELECT run_id FROM
(
    SELECT run_id, started AS since FROM {view('runs')}
    WHERE $__conditionalAll(`group` IN (${{group:singlequote}}), $group)
      AND $__conditionalAll(hasAny(tags, [${{tag:singlequote}}]), $tag)
    UNION ALL
    SELECT run_id, min(first_ts) AS since FROM {stored('step_aggregates')}
    WHERE run_id NOT IN (SELECT run_id FROM {stored('runs')})
      AND $__conditionalAll(1 = 0, $group) AND $__conditionalAll(1 = 0, $tag)
    GROUP BY run_id
)
GROUP BY run_id
ORDER BY max(since) DESC"""


# The nodes of the chosen runs: from their run events (every rank sends one at start), and, for
# a run that sent none, from its steps; never a scan of every step row of the runs.
NODE_PICKER = f"""SELECT DISTINCT node FROM
(
    SELECT node FROM {stored('runs')} WHERE {RUN_FILTER}
    UNION ALL
    SELECT node FROM {stored('steps')}
    WHERE run_id IN (SELECT arrayJoin([${{run:singlequote}}]) AS r WHERE r NOT IN (SELECT run_id FROM {stored('runs')}))
)
ORDER BY node"""


def variables() -> list[dash_b.QueryVariable]:
    """group and tag (multi, with All), run (multi, newest first), node and dataset (multi, with All)."""
    return [
        variable(
            "group",
            "Group",
            f"SELECT DISTINCT `group` FROM {view('runs')} WHERE `group` IS NOT NULL AND `group` != '' ORDER BY `group`",
            include_all=True,
            description="Run groups (init(group=...)); narrows the Run list.",
        ),
        variable(
            "tag",
            "Tag",
            f"SELECT DISTINCT arrayJoin(tags) AS tag FROM {view('runs')} ORDER BY tag",
            include_all=True,
            description="Run tags (init(tags=[...])); narrows the Run list to runs with any chosen tag.",
        ),
        variable(
            "run",
            "Run",
            RUN_PICKER,
            include_all=False,
            description="Training runs (newest first); pick several to compare them.",
        ),
        variable(
            "node",
            "Node",
            NODE_PICKER,
            include_all=True,
            description="Nodes of the chosen runs.",
        ),
        variable(
            "dataset",
            "Dataset",
            f"SELECT DISTINCT dataset FROM {view('evals')} WHERE {RUN_FILTER} ORDER BY dataset",
            include_all=True,
            description="Evaluation datasets of the chosen runs.",
        ),
    ]


def variable(name: str, label: str, sql: str, *, include_all: bool, description: str) -> dash_b.QueryVariable:
    var = (
        dash_b.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(datasource_ref())
        .query({"editorType": "sql", "rawSql": sql, "format": int(Format.TABLE)})
        .multi(True)
        .include_all(include_all)
        .refresh(dashboard.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard.VariableSort.DISABLED)
    )
    if include_all:
        var = var.current(dashboard.VariableOption(selected=True, text=["All"], value=[ALL]))
    # without a current value Grafana selects the first option: the newest run
    return var


# ---------------------------------------------------------------- annotations


def annotation(name: str, color: str, sql: str) -> dash_b.AnnotationQuery:
    """Markers from ClickHouse rows with columns time, title, text, tags."""
    return (
        dash_b.AnnotationQuery()
        .name(name)
        .datasource(datasource_ref())
        .enable(True)
        .icon_color(color)
        .target(AnnotationTarget(SQL(sql, expects=("time", "title", "text", "tags"))))
    )


def builtin_annotations() -> dash_b.AnnotationQuery:
    return (
        dash_b.AnnotationQuery()
        .name("Annotations & Alerts")
        .datasource(dashboard.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
        .enable(True)
        .hide(True)
        .icon_color("rgba(0, 211, 255, 1)")
        .type("dashboard")
        .built_in(1)
    )


COMMAND_MARKERS_SQL = f"""SELECT
    ts AS time,
    concat(command, if(target_node IS NULL, '', concat(' @', target_node))) AS title,
    concat(command, ' ', args, if(reason = '', '', concat(': ', reason))) AS text,
    concat('command,', command) AS tags
FROM {view('commands')}
WHERE $__timeFilter(ts) AND {RUN_FILTER}
ORDER BY time"""

ALERT_MARKERS_SQL = f"""SELECT
    ts AS time,
    concat(severity, ': ', kind) AS title,
    message AS text,
    concat('alert,', severity, ',', kind) AS tags
FROM {view('alerts')}
WHERE $__timeFilter(ts) AND {RUN_FILTER} AND severity != 'info'
ORDER BY time"""


# --------------------------------------------------------------------- panels


def _legend(calcs: list[str] | None = None) -> common_b.VizLegendOptions:
    legend = (
        common_b.VizLegendOptions()
        .show_legend(True)
        .display_mode(common.LegendDisplayMode.TABLE if calcs else common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM)
    )
    return legend.calcs(calcs) if calcs else legend


def _tooltip() -> common_b.VizTooltipOptions:
    return common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)


def timeseries(
    title: str,
    description: str,
    queries: list[SQL],
    *,
    unit: str,
    width: int = 12,
    height: int = 8,
    calcs: list[str] | None = None,
    axis_label: str | None = None,
) -> ts_b.Panel:
    """A time series: each query returns `time` plus value columns (long rows become series)."""
    panel = (
        ts_b.Panel()
        .title(title)
        .description(description)
        .datasource(datasource_ref())
        .unit(unit)
        .span(width)
        .height(height)
        .legend(_legend(calcs))
        .tooltip(_tooltip())
        .line_width(2)
        .fill_opacity(5)
        .show_points(common.VisibilityMode.AUTO)
        .point_size(4)
        .span_nulls(True)
    )
    if axis_label:
        panel = panel.axis_label(axis_label)
    for ref, query in zip("ABCDEFGH", queries):
        panel = panel.with_target(query.ref_id(ref))
    return panel


def trend(
    title: str,
    description: str,
    query: SQL,
    *,
    x_field: str,
    unit: str,
    partition_by: str,
    width: int = 12,
    height: int = 8,
    axis_label: str | None = None,
) -> trend_b.Panel:
    """Values over a numeric x (the training step), one series per value of `partition_by`."""
    panel = (
        trend_b.Panel()
        .title(title)
        .description(description)
        .datasource(datasource_ref())
        .with_target(query.ref_id("A"))
        .x_field(x_field)
        .unit(unit)
        .span(width)
        .height(height)
        .legend(_legend(["lastNotNull", "max"]))
        .tooltip(_tooltip())
        .line_width(2)
        .show_points(common.VisibilityMode.AUTO)
        .point_size(4)
        .span_nulls(True)
        .with_transformation(partition_by_values(partition_by))
    )
    if axis_label:
        panel = panel.axis_label(axis_label)
    return panel


def partition_by_values(field: str) -> dashboard.DataTransformerConfig:
    """Grafana's "Partition by values": one frame (series) per distinct value of `field`."""
    return dashboard.DataTransformerConfig(
        id_val="partitionByValues",
        options={"fields": [field], "keepFields": False},  # default naming: the value becomes a label
    )


def table(title: str, description: str, query: SQL, *, width: int = 24, height: int = 9) -> table_b.Panel:
    return (
        table_b.Panel()
        .title(title)
        .description(description)
        .datasource(datasource_ref())
        .with_target(query.ref_id("A"))
        .span(width)
        .height(height)
        .filterable(True)
        .cell_height(common.TableCellHeight.SM)
    )


def stat(title: str, description: str, query: SQL, *, unit: str, width: int = 6, height: int = 4) -> stat_b.Panel:
    return (
        stat_b.Panel()
        .title(title)
        .description(description)
        .datasource(datasource_ref())
        .with_target(query.ref_id("A"))
        .unit(unit)
        .span(width)
        .height(height)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .graph_mode(common.BigValueGraphMode.AREA)
    )


def base(uid: str, title: str, description: str, tags: list[str]) -> dash_b.Dashboard:
    """A dashboard with our time settings, the variables and the built-in annotations."""
    board = (
        dash_b.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["areal", *tags])
        .editable()
        .refresh(REFRESH)
        .time(*DEFAULT_RANGE)
        .timezone("browser")
        .tooltip(dashboard.DashboardCursorSync.CROSSHAIR)
        .timepicker(dash_b.TimePicker().refresh_intervals(REFRESH_CHOICES))
        .annotation(builtin_annotations())
    )
    for var in variables():
        board = board.with_variable(var)
    return board
