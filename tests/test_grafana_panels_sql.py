"""Every panel, variable and annotation query runs against ClickHouse loaded with a real run.

The queries are expanded as Grafana and the ClickHouse plugin would expand
them (template variables resolved from their own queries, `$__timeFilter`,
`$__timeInterval`, `$__conditionalAll`, ...; repeated panels once per value)
and run on the embedded engine holding tests/data/demo_events.jsonl, loaded
through the sink's code path. Each must return rows with the columns its
panel reads; a broken query fails here with the panel's name and the SQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest

from areal_metrics.grafana.catalog import BUILDERS, build
from areal_metrics.grafana.clickhouse import SQL, Format
from areal_metrics.grafana.queries import (
    DashboardQuery,
    QueryRunner,
    check_dashboard,
    check_query,
    context_for,
    dashboard_queries,
    resolve_variables,
)
from tests.test_grafana_data import RUNS, fixture_events, fixture_span, loaded_store


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[QueryRunner]:
    with loaded_store(tmp_path_factory.mktemp("grafana-store")) as store:
        yield QueryRunner.of_store(store)


@pytest.fixture(scope="module")
def span() -> tuple:
    start, end = fixture_span(fixture_events())
    return start - timedelta(minutes=5), end + timedelta(minutes=5)


def _report(outcomes: list) -> str:
    return "\n\n".join(f"{o.query.where} {o.context}: {o.problem}\n{o.sql}" for o in outcomes if o.problem)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_query_returns_the_columns_its_panel_reads(name: str, runner: QueryRunner, span: tuple) -> None:
    outcomes = check_dashboard(build(name), runner, *span)
    assert outcomes, "no queries found"
    assert not [o for o in outcomes if o.problem], _report(outcomes)
    kinds = {o.query.kind for o in outcomes}
    assert "panel" in kinds and "variable" in kinds


@pytest.mark.parametrize("name", list(BUILDERS))
def test_queries_also_work_for_one_run_one_node_one_dataset(name: str, runner: QueryRunner, span: tuple) -> None:
    picks = {"run": (RUNS[1],)}

    def choose(var: str, options: list[str]) -> tuple[str, ...]:
        return picks.get(var, (options[0],))

    outcomes = check_dashboard(build(name), runner, *span, choose=choose)
    assert not [o for o in outcomes if o.problem], _report(outcomes)


def test_variables_resolve_to_the_runs_nodes_and_datasets_of_the_run(runner: QueryRunner, span: tuple) -> None:
    ctx = resolve_variables(build("training"), runner, context_for(*span))
    assert set(ctx.variables["run"].options) == set(RUNS)
    assert len(ctx.variables["node"].options) == 2  # one node name per rank of the vote
    assert set(ctx.variables["dataset"].options) == {"add_1digit", "add_2digit"}


def test_repeated_panel_runs_once_per_dataset(runner: QueryRunner, span: tuple) -> None:
    model = build("evaluation")
    ctx = resolve_variables(model, runner, context_for(*span))
    repeated = [q for q in dashboard_queries(model) if q.repeat == "dataset"]
    assert repeated
    outcomes = check_query(repeated[0], runner, ctx)
    assert sorted(o.context for o in outcomes) == ["dataset=add_1digit", "dataset=add_2digit"]
    assert all(o.problem is None and o.rows > 0 for o in outcomes), _report(outcomes)


def test_the_explorer_offers_every_logged_key_and_draws_each_per_run(runner: QueryRunner, span: tuple) -> None:
    model = build("explorer")
    ctx = resolve_variables(model, runner, context_for(*span))
    keys = set(ctx.variables["metric"].options)
    assert {"mem_bytes", "lr_scale", "eval_interval"} <= keys  # what the demo trainer logs beyond the columns
    repeated = [q for q in dashboard_queries(model) if q.repeat == "metric"]
    outcomes = check_query(repeated[0], runner, ctx)
    assert sorted(o.context for o in outcomes) == sorted(f"metric={k}" for k in keys)
    assert all(o.problem is None and o.rows > 0 for o in outcomes), _report(outcomes)


def test_a_broken_panel_query_is_reported(runner: QueryRunner, span: tuple) -> None:
    ctx = resolve_variables(build("training"), runner, context_for(*span))
    broken = [
        DashboardQuery("typo in a column", "SELECT ts AS time, rewrd FROM areal.steps FINAL WHERE $__timeFilter(ts)",
                       Format.TIME_SERIES, ("time",), "panel"),
        DashboardQuery("undefined variable", "SELECT ts AS time FROM areal.steps WHERE run_id IN (${runs:singlequote})",
                       Format.TIME_SERIES, ("time",), "panel"),
        DashboardQuery("wrong column name", "SELECT ts AS time, reward AS r FROM areal.steps FINAL",
                       Format.TIME_SERIES, ("time", "reward"), "panel"),
        DashboardQuery("nothing in range", "SELECT ts AS time FROM areal.steps FINAL WHERE ts < '2000-01-01'",
                       Format.TIME_SERIES, ("time",), "panel"),
        DashboardQuery("no time column", "SELECT step AS time, reward FROM areal.steps FINAL",
                       Format.TIME_SERIES, ("time",), "panel"),
    ]
    problems = [check_query(q, runner, ctx)[0].problem for q in broken]
    assert problems[0] and "ClickHouse error" in problems[0]
    assert problems[1] and "unexpanded" in problems[1]
    assert problems[2] and "missing column" in problems[2]
    assert problems[3] == "no rows"
    assert problems[4] and "DateTime" in problems[4]


def test_panel_sql_filters_really_apply(runner: QueryRunner, span: tuple) -> None:
    """One run selected: a reward query sees that run only; All nodes vs one node changes the rows."""
    model = build("training")
    one_run = resolve_variables(model, runner, context_for(*span), lambda v, o: (RUNS[0],) if v == "run" else "$__all")
    from areal_metrics.grafana.macros import expand

    sql = expand("SELECT DISTINCT run_id FROM areal.steps FINAL WHERE $__timeFilter(ts) AND run_id IN (${run:singlequote})"
                 " AND $__conditionalAll(node IN (${node:singlequote}), $node)", one_run)
    _, _, rows = runner.run(sql)
    assert rows == [(RUNS[0],)]
    nodes = one_run.variables["node"].options
    one_node = resolve_variables(model, runner, context_for(*span),
                                 lambda v, o: (RUNS[0],) if v == "run" else (o[0],))
    count = "SELECT count() FROM areal.steps FINAL WHERE run_id IN (${run:singlequote}) AND $__conditionalAll(node IN (${node:singlequote}), $node)"
    all_rows = runner.run(expand(count, one_run))[2][0][0]
    node_rows = runner.run(expand(count, one_node))[2][0][0]
    assert len(nodes) == 2 and all_rows == 2 * node_rows


def test_sql_builder_keeps_expectations() -> None:
    q = SQL("SELECT 1 AS x", expects=("x",)).ref_id("B").build()
    assert q.expects == ("x",) and q.to_json()["refId"] == "B"
    assert "expects" not in q.to_json()  # not part of what Grafana stores


def test_every_dashboard_has_queries_on_all_the_variables() -> None:
    for name in BUILDERS:
        model = build(name)
        names = [v.name for v in model.templating.list_val]
        # each board's own variables: the explorer's metric keys, the evaluation board's generations filters
        # and the efficiency board's per-rank bounds (a text box and a constant: no query)
        own = {"explorer": ["metric"], "evaluation": ["gen_step", "verdict", "error_type"],
               "efficiency": ["ranks", "rank_raw_rows", "rank_coarse_rows"]}.get(name, [])
        assert names == ["group", "tag", "run", "node", "dataset", *own], name
        assert model.refresh == "5s"



def test_cli_check_runs_every_query_against_the_configured_store(
    runner: QueryRunner, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from areal_metrics.cli import main

    store_dir = next(p for p in tmp_path_factory.getbasetemp().iterdir() if p.name.startswith("grafana-store"))
    monkeypatch.setenv("AREAL_CLICKHOUSE_URL", f"chdb://{store_dir}")
    assert main(["grafana", "check", "--since", "3650d"]) == 0
    captured = capsys.readouterr()
    assert " 0 failed" in captured.err and "FAILED" not in captured.out
    assert "Reward: raw, sliding average and EMA" in captured.out and "no rows" not in captured.out
    assert main(["grafana", "check", "--since", "soon"]) == 2


def test_alerts_table_links_an_alert_to_the_command_it_caused(runner: QueryRunner, span: tuple) -> None:
    from areal_metrics.grafana.alerts import ALERTS_WITH_COMMANDS
    from areal_metrics.grafana.macros import expand

    ctx = resolve_variables(build("alerts"), runner, context_for(*span))
    columns, _, rows = runner.run(expand(ALERTS_WITH_COMMANDS.build().raw_sql, ctx))
    kind, caused = columns.index("kind"), columns.index("commands caused")
    eval_alerts = [r for r in rows if r[kind] == "eval_below_threshold"]  # the closed loop on evaluation
    assert eval_alerts and all('scale_lr {"factor":0.5,"from_step":' in r[caused] for r in eval_alerts)
