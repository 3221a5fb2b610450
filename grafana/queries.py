"""Every query of a dashboard, run the way Grafana would run it, and checked.

`dashboard_queries(model)` lists panel targets, variable queries and
annotations with what each must return (`expects`). `check_dashboard(...)`
resolves the variables from the store like Grafana does (each variable's own
query, in order, with the earlier variables expanded), expands each query
(`macros.expand`), runs it and reports what is wrong: a SQL error, no rows,
a missing column, a time series without a time column, a non-numeric value.

Used by the tests (against a store loaded from a real run) and by
`areal-metrics grafana check` (against the configured store).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from grafana_foundation_sdk.models import dashboard

from areal_metrics.grafana.clickhouse import ClickHouseAnnotationTarget, ClickHouseQuery, Format
from areal_metrics.grafana.macros import ALL, QueryContext, Variable, auto_interval, expand

NUMERIC = ("Int", "UInt", "Float", "Decimal", "Nullable(Int", "Nullable(UInt", "Nullable(Float", "Nullable(Decimal")


@dataclass(frozen=True)
class DashboardQuery:
    where: str  # "panel 'Reward' target A"
    sql: str
    format: Format
    expects: tuple[str, ...]
    kind: str  # panel | variable | annotation
    repeat: str | None = None  # the variable the panel repeats over
    numeric: tuple[str, ...] = ()  # columns that must be numbers (trend x field, value columns)


@dataclass
class Outcome:
    query: DashboardQuery
    sql: str  # as expanded
    context: str
    rows: int = 0
    columns: list[str] = field(default_factory=list)
    problem: str | None = None

    @property
    def empty(self) -> bool:
        """No data yet (no rows, or a value column NULL throughout: a column nobody logged), not a broken query."""
        return self.problem is not None and (self.problem == NO_ROWS or self.problem.endswith(ALL_NULL))


class QueryRunner:
    """What the check needs from a store: run SQL, get columns, their types and rows."""

    def __init__(self, run: Callable[[str], tuple[list[str], list[str], list[tuple[Any, ...]]]]) -> None:
        self.run = run

    @classmethod
    def of_store(cls, store: Any) -> QueryRunner:
        """From a `areal_metrics.sinks.query` store (`.query(sql)` -> QueryResult)."""

        def run(sql: str) -> tuple[list[str], list[str], list[tuple[Any, ...]]]:
            result = store.query(sql)
            return result.columns, result.types, result.rows

        return cls(run)


def dashboard_queries(model: dashboard.Dashboard) -> list[DashboardQuery]:
    out: list[DashboardQuery] = []
    for var in (model.templating.list_val or []) if model.templating else []:
        if isinstance(var.query, dict) and "rawSql" in var.query:
            out.append(DashboardQuery(f"variable {var.name!r}", str(var.query["rawSql"]), Format.TABLE, (), "variable"))
    for item in model.annotations.list_val or [] if model.annotations else []:
        if isinstance(item.target, ClickHouseAnnotationTarget):
            q = item.target.query
            out.append(DashboardQuery(f"annotation {item.name!r}", q.raw_sql, q.format, q.expects, "annotation"))
    for panel in model.panels or []:
        if not isinstance(panel, dashboard.Panel):
            continue
        x_field = _option(panel.options, "x_field")
        for target in panel.targets or []:
            if not isinstance(target, ClickHouseQuery):
                continue
            numeric = _numeric_columns(target, x_field, panel)
            out.append(DashboardQuery(f"panel {panel.title!r} target {target.ref_id}", target.raw_sql, target.format,
                                      target.expects, "panel", panel.repeat, numeric))
    return out


def _option(options: Any, name: str) -> Any:
    return getattr(options, name, None) if options is not None else None


def _numeric_columns(target: ClickHouseQuery, x_field: str | None, panel: dashboard.Panel) -> tuple[str, ...]:
    """Value columns of plotted panels must be numbers (labels and the time column excepted)."""
    if panel.type_val not in ("timeseries", "trend", "stat"):
        return ()
    labels = {"time", "run_id", "series", "worker", "kind", "node", "dataset"}
    return tuple(c for c in target.expects if c not in labels or c == x_field)


# ----------------------------------------------------------------- variables


def resolve_variables(model: dashboard.Dashboard, runner: QueryRunner, ctx: QueryContext,
                      choose: Callable[[str, list[str]], str | tuple[str, ...]] | None = None) -> QueryContext:
    """Run each variable's query in order (expanding the ones before it), as Grafana does.

    `choose(name, options)` picks the current value; default: every run, and
    "All" for the variables that offer it.
    """
    variables: dict[str, Variable] = dict(ctx.variables)
    for var in (model.templating.list_val or []) if model.templating else []:
        if var.type_val in ("textbox", "constant"):  # a value typed in, or fixed in the dashboard
            current = var.current.value if var.current is not None and var.current.value is not None else var.query
            variables[var.name] = Variable(var.name, str(current))
            continue
        if not (isinstance(var.query, dict) and "rawSql" in var.query):
            continue
        sql = expand(str(var.query["rawSql"]), replace(ctx, variables=variables))
        _, _, rows = runner.run(sql)
        options = [str(r[0]) for r in rows]
        if choose is not None:
            value = choose(var.name, options)
        else:
            value = ALL if var.include_all else tuple(options)
        variables[var.name] = Variable(var.name, value, tuple(options), var.all_value)
    return replace(ctx, variables=variables)


def context_for(start: datetime, end: datetime) -> QueryContext:
    return QueryContext(start=start, end=end, interval=auto_interval(start, end))


# --------------------------------------------------------------------- check


def expansions(q: DashboardQuery, ctx: QueryContext) -> Iterator[tuple[str, QueryContext]]:
    """A repeated panel runs once per value of its variable, with that value alone in scope."""
    if q.repeat is None or q.repeat not in ctx.variables:
        yield "", ctx
        return
    var = ctx.variables[q.repeat]
    values = var.options if var.is_all else (var.value if isinstance(var.value, tuple) else (var.value,))
    for value in values:
        scoped = {**ctx.variables, q.repeat: Variable(q.repeat, value, var.options)}
        yield f"{q.repeat}={value}", replace(ctx, variables=scoped)


def check_query(q: DashboardQuery, runner: QueryRunner, ctx: QueryContext) -> list[Outcome]:
    outcomes = []
    for label, scoped in expansions(q, ctx):
        try:
            sql = expand(q.sql, scoped)
        except ValueError as exc:
            outcomes.append(Outcome(q, q.sql, label, problem=f"cannot expand: {exc}"))
            continue
        outcome = Outcome(q, sql, label)
        outcomes.append(outcome)
        if "$" in sql:
            outcome.problem = "unexpanded variable or macro left in the SQL"
            continue
        try:
            columns, types, rows = runner.run(sql)
        except Exception as exc:  # noqa: BLE001 - any failure of the SQL is the finding
            outcome.problem = f"ClickHouse error: {' '.join(str(exc).split())[:500]}"
            continue
        outcome.rows, outcome.columns = len(rows), list(columns)
        outcome.problem = _shape_problem(q, columns, types, rows)
    return outcomes


NO_ROWS = "no rows"
ALL_NULL = "is NULL in every row"


def _shape_problem(q: DashboardQuery, columns: Sequence[str], types: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> str | None:
    if not rows:
        return NO_ROWS
    missing = [c for c in q.expects if c not in columns]
    if missing:
        return f"missing column(s) {missing}; got {list(columns)}"
    type_of = dict(zip(columns, types))
    if q.kind == "variable":
        if len(columns) != 1 or any(r[0] in (None, "") for r in rows):
            return f"a variable query must return one column of non-empty values; got {list(columns)}"
        return None
    if q.format is Format.TIME_SERIES or q.kind == "annotation":
        if "time" not in type_of or not type_of["time"].startswith(("DateTime", "Nullable(DateTime")):
            return f"needs a DateTime column 'time'; got {type_of}"
    for name in q.numeric:
        if name not in type_of:
            continue
        if not type_of[name].startswith(NUMERIC):
            return f"column {name!r} must be numeric, is {type_of[name]}"
        index = list(columns).index(name)
        if all(r[index] is None for r in rows):
            return f"column {name!r} {ALL_NULL}"
    return None


def check_dashboard(model: dashboard.Dashboard, runner: QueryRunner, start: datetime, end: datetime,
                    choose: Callable[[str, list[str]], str | tuple[str, ...]] | None = None) -> list[Outcome]:
    ctx = resolve_variables(model, runner, context_for(start, end), choose)
    outcomes: list[Outcome] = []
    for q in dashboard_queries(model):
        outcomes.extend(check_query(q, runner, ctx))
    return outcomes
