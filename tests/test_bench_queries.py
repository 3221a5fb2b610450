"""The query benchmark's generated store (`benchmarks.query_data`), at a small shape: what it holds, and that
every dashboard query finds data in it (a timing taken on empty panels would prove nothing). No timings here."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from benchmarks.bench_queries import SCENARIOS, build_store, measure
from benchmarks.query_data import Shape
from areal_metrics.grafana.catalog import BUILDERS, build
from areal_metrics.grafana.queries import QueryRunner, check_dashboard
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.sinks.query import DirectStore, connect

SHAPE = Shape(runs=4, ranks=8, steps=300, resume_from=150, resumed_steps=40, tail_steps=30, sink_rows=50)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectStore]:
    directory: Path = tmp_path_factory.mktemp("bench-store")
    built = build_store(directory, SHAPE)
    assert built["steps_rows_stored"] > SHAPE.rows  # the re-sent events are stored twice...
    with connect(Settings(clickhouse_url=f"chdb://{directory}")) as opened:
        assert isinstance(opened, DirectStore)
        yield opened


def test_the_store_holds_every_step_once_with_the_newest_run_resumed(store: DirectStore) -> None:
    assert store.command("SELECT count() FROM v_steps") == SHAPE.rows  # ...and counted once
    assert store.command("SELECT uniqExact(run_id, step, rank) FROM steps") == SHAPE.rows
    attempts = store.query(f"SELECT attempt, min(step), max(step) FROM v_steps WHERE run_id = '{SHAPE.newest}' "
                           "GROUP BY attempt ORDER BY attempt").rows
    assert attempts == [(0, 1, SHAPE.resume_from - 1), (1, SHAPE.resume_from, SHAPE.steps)]
    newest_end = store.command(f"SELECT toUnixTimestamp(max(ts)) FROM v_steps WHERE run_id = '{SHAPE.newest}'")
    assert abs(int(newest_end) - SHAPE.now) < 60
    for table in ("rewards_smoothed", "evals", "generations", "eval_consensus", "alerts", "commands", "runs"):
        assert store.command(f"SELECT uniqExact(run_id) FROM v_{table}") == SHAPE.runs, table


@pytest.mark.parametrize("name", list(BUILDERS))
def test_every_dashboard_query_finds_data_in_the_generated_store(store: DirectStore, name: str) -> None:
    now = datetime.fromtimestamp(SHAPE.now, timezone.utc)
    pick_newest = SCENARIOS[1].choose
    outcomes = check_dashboard(build(name), QueryRunner.of_store(store), now - timedelta(hours=24), now, pick_newest)
    empty_allowed = {"annotation 'Alerts'"}  # alerts of severity info only at the newest run's last steps
    problems = [f"{o.query.where}: {o.problem}" for o in outcomes
                if o.problem and not (o.problem == "no rows" and o.query.where in empty_allowed)]
    assert not problems


def test_measure_reports_every_distinct_query_with_percentiles(store: DirectStore) -> None:
    now = datetime.fromtimestamp(SHAPE.now, timezone.utc)
    entries = measure(store, SCENARIOS[1], 2, now)
    assert len(entries) > 40 and len({e["query"] for e in entries}) == len(entries)
    assert all(e["p50_ms"] <= e["p95_ms"] <= e["max_ms"] and e["rows_read"] > 0 and e["cpu_ms_p50"] >= 0 for e in entries
               if e["kind"] == "panel")
    assert all(e["rows_selected"] > 0 for e in entries if e["kind"] == "panel")  # the engine's own count
