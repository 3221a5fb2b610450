"""Every dashboard query and the report give the same numbers as before the query rework.

`tests/data/panel_results.json` holds what every panel, variable and
annotation query (expanded as Grafana expands it) and the report's loaders
returned on the recorded demo run, recorded by `tests/data/make_panel_results.py`
at commit 439b732, before schema version 4 (partitioned tables, panels
reading the views), and recorded again on the i11-workload branch when the
fixture's derived events were derived again by the current stream worker
(`make_demo_events.py --rederive`: the reward rule only alerts, `scale_lr`
comes from the closed loop on evaluation) and the report read full-stage,
n_samples-weighted numbers; and again on the i27 branch (the vote per sample with ties
undecided, intervals on the consensus, set_eval_interval only for adaptive runs); and on the i32 branch
(the evaluation details: consensus metrics, the generations filters; it was already behind the report's
intervals before); and on the trainers branch (issue 41: the fixture's trainers acknowledge the worker's
`scale_lr`, the evaluation board's 'Commands applied' annotation; the dead letters' raw step now spells
its epoch 16.0, as today's StepEvent writes it); and on the scale branch (per-step curves read
v_step_means: the rank mean weighted by n_samples, one time per step (its newest rank's), over all
nodes; the reward-by-step and the explorer's trends downsampled to one point per time bucket (the
explorer's last value a step's rank mean); latency per run as the ranks' mean and slowest rank); and on the
rankpanels branch (the efficiency board's 'Nodes and ranks' table adds the mean and the maximum step
latency; on the demo run, a short range, every per-rank panel reads the raw rows again: the series and the
p95 are main's numbers to the digit).
This test runs the same queries of the current code on
the current schema and compares column names and every value (floats to 12
significant digits: a sum may be added up in another order; rows as a
multiset, since ties in an ORDER BY may come in either order).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.analysis.report import load_evals, load_rewards, load_throughput
from areal_metrics.grafana.catalog import BUILDERS, build
from areal_metrics.grafana.macros import expand
from areal_metrics.grafana.queries import QueryRunner, context_for, dashboard_queries, expansions, resolve_variables
from tests.test_grafana_data import RUNS, fixture_events, fixture_span, loaded_store

GOLDEN = Path(__file__).parent / "data" / "panel_results.json"
CONTEXTS: dict[str, Callable[[str, list[str]], Any] | None] = {
    "every run, All": None,
    "one run, one node, one dataset": lambda var, options: (RUNS[1],) if var == "run" else (options[0],),
}


def normal(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return float(f"{value:.12g}")
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, dict):
        return [[normal(k), normal(v)] for k, v in sorted(value.items())]
    if isinstance(value, (list, tuple)):
        return [normal(v) for v in value]
    if hasattr(value, "_asdict"):
        return normal(tuple(value))
    if hasattr(value, "__dataclass_fields__"):
        return normal([getattr(value, f) for f in value.__dataclass_fields__])
    return repr(value)


def _rows(rows: list[Any]) -> list[Any]:
    return sorted((normal(r) for r in rows), key=lambda r: json.dumps(r, sort_keys=True))


def capture(runner: QueryRunner, store: Any, span: tuple[dt.datetime, dt.datetime]) -> dict[str, Any]:
    """{query: {columns, rows}} for every dashboard query in both contexts, and the report's data."""
    out: dict[str, Any] = {}
    for name in BUILDERS:
        model = build(name)
        for label, choose in CONTEXTS.items():
            ctx = resolve_variables(model, runner, context_for(*span), choose)
            for q in dashboard_queries(model):
                for scope, scoped in expansions(q, ctx):
                    columns, _, rows = runner.run(expand(q.sql, scoped))
                    key = f"{name} | {label} | {q.where}" + (f" [{scope}]" if scope else "")
                    out[key] = {"columns": list(columns), "rows": _rows(rows)}
    evals = load_evals(store, "1")
    out["report | evals"] = {d: {r: normal(points) for r, points in runs.items()} for d, runs in evals.items()}
    raw, smooth = load_rewards(store, "1")
    out["report | rewards"] = {"raw": normal(dict(raw)), "smooth": normal(dict(smooth))}
    throughput = load_throughput(store, "1")
    out["report | throughput"] = normal({f"{r} {n}": v for (r, n), v in throughput.items()})
    return out


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    start, end = fixture_span(fixture_events())
    span = (start - timedelta(minutes=5), end + timedelta(minutes=5))
    with loaded_store(tmp_path_factory.mktemp("panel-numbers")) as store:
        yield capture(QueryRunner.of_store(store), store, span)


def test_every_query_and_the_report_give_the_recorded_numbers(captured: dict[str, Any]) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert set(captured) == set(golden)
    different = [key for key in golden if captured[key] != golden[key]]
    assert not different, f"{len(different)} queries changed, first: {different[0]}\n" \
                          f"now:    {json.dumps(captured[different[0]])[:1500]}\n" \
                          f"before: {json.dumps(golden[different[0]])[:1500]}"


def test_the_recording_is_not_empty(captured: dict[str, Any]) -> None:
    """A comparison of empty results would prove nothing: most panels have rows in both contexts."""
    panels = {k: v for k, v in captured.items() if "| panel" in k}
    assert len(panels) > 60
    assert sum(1 for v in panels.values() if v["rows"]) >= 0.9 * len(panels)
