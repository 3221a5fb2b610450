"""Dashboard queries on 10 million step rows: every panel's, variable's and annotation's SQL,
expanded as Grafana expands it, timed on the embedded engine.

    python -m benchmarks.bench_queries [--repetitions N] [--json PATH] [--keep DIR]

The store is generated in a temporary directory (`benchmarks.query_data`:
50 runs x 64 ranks x 3,125 steps, the newest run resumed and partly
delivered twice), through the current schema. Each distinct query runs once
untimed, once through `areal_metrics.sinks.query` with its rows turned into Python tuples
(what `report` and `grafana check` pay, timed once), then `N` times timed:

- wall ms: the engine running the query to its whole result in ClickHouse's
  Native format (what the sink's HTTP endpoint hands Grafana's driver), on
  the same client; p50 and p95 over the `N` runs;
- CPU ms: the CPU time this process (the engine's threads) spent on it,
  p50: on a shared machine the wall time is the CPU time stretched by the
  other processes' load, the CPU time is not;
- rows read: the engine's own estimate (`EXPLAIN ESTIMATE`).

Scenarios (node, dataset, group, tag: All):

- `newest run, last 30 min`: the dashboards' defaults (their time range, and
  the run Grafana selects first: the newest the picker offers). Its slowest
  p95 is `panel_ms_p95_max`;
- `newest run, last 24 h`: the same run over its whole life (`panel_ms_p95_max_24h`);
- `every run, last 7 days`: all 50 runs ticked (`panel_ms_p95_max_7d_all_runs`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from benchmarks.common import machine, percentile
from benchmarks.query_data import Shape, generate
from areal_metrics.grafana.catalog import BUILDERS, build
from areal_metrics.grafana.macros import ALL, expand
from areal_metrics.grafana.queries import (
    QueryRunner,
    context_for,
    dashboard_queries,
    expansions,
    resolve_variables,
)
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.sinks.migrations import apply_schema
from areal_metrics.sinks.query import DirectStore, Target, connect, open_client
from areal_metrics.sinks.schema import DEFAULT_DATABASE

Choose = Callable[[str, list[str]], Any]


@dataclass(frozen=True)
class Scenario:
    label: str
    key: str  # the figure its slowest p95 is written as
    span: timedelta
    all_runs: bool = False

    def choose(self, name: str, options: list[str]) -> Any:
        if name == "run":
            return tuple(options) if self.all_runs else (options[0],)  # Grafana's default: the first (newest)
        return ALL


SCENARIOS = (
    Scenario("newest run, last 30 min", "panel_ms_p95_max", timedelta(minutes=30)),
    Scenario("newest run, last 24 h", "panel_ms_p95_max_24h", timedelta(hours=24)),
    Scenario("every run, last 7 days", "panel_ms_p95_max_7d_all_runs", timedelta(days=7), all_runs=True),
)


def build_store(directory: Path, shape: Shape) -> dict[str, float]:
    """Generate the store; seconds taken and row counts."""
    client = open_client(Target.parse(f"chdb://{directory}"), readonly=False, use_database=False)
    try:
        t0 = time.perf_counter()
        apply_schema(client)
        generate(client, DEFAULT_DATABASE, shape)
        client.command("SYSTEM STOP MERGES")  # every repetition reads the same parts
        seconds = time.perf_counter() - t0
        raw = int(client.command(f"SELECT count() FROM {DEFAULT_DATABASE}.steps"))
        parts = int(client.command(f"SELECT count() FROM system.parts WHERE database = '{DEFAULT_DATABASE}' "
                                   "AND table = 'steps' AND active"))
    finally:
        client.close()
    return {"generate_s": seconds, "steps_rows_stored": raw, "steps_parts": parts}


def rows_read(store: DirectStore, sql: str) -> int:
    """The engine's estimate of the rows it reads for `sql` (all tables): a figure no other load changes."""
    try:
        return sum(int(r[3]) for r in store.query(f"EXPLAIN ESTIMATE {sql}").rows)
    except Exception:  # noqa: BLE001 - e.g. a query EXPLAIN ESTIMATE cannot plan: the timing still counts
        return -1


_SELECTED = "SELECT value FROM system.events WHERE event = 'SelectedRows'"


def rows_selected(store: DirectStore, sql: str) -> int:
    """The rows the engine read running `sql` once: the growth of its SelectedRows counter, less what
    reading the counter adds. Unlike the estimate it sees a branch that a scalar made constant false
    read nothing (the efficiency board's per-rank panels, grafana/efficiency.py)."""
    def counter() -> int:
        rows = store.query(_SELECTED).rows
        return int(rows[0][0]) if rows else 0
    base = counter()
    probe = counter() - base  # the rows one read of the counter adds
    before = counter()
    store.client.raw_query(sql, fmt="Native")
    return counter() - before - probe


def _cpu_ms() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime) * 1000


def _engine(store: DirectStore, sql: str) -> tuple[float, float]:
    """(wall ms, CPU ms) of the engine producing the whole result as Native bytes."""
    cpu, t0 = _cpu_ms(), time.perf_counter()
    store.client.raw_query(sql, fmt="Native")
    return (time.perf_counter() - t0) * 1000, _cpu_ms() - cpu


def _python_rows(store: DirectStore, sql: str) -> tuple[float, int]:
    """(wall ms, rows) through `areal_metrics.sinks.query`, rows as Python tuples."""
    t0 = time.perf_counter()
    rows = len(store.query(sql).rows)
    return (time.perf_counter() - t0) * 1000, rows


def measure(store: DirectStore, scenario: Scenario, repetitions: int, now: datetime,
            python_rows: bool = True) -> list[dict[str, Any]]:
    """One entry per distinct expanded query of every dashboard: where it is, rows, p50/p95 ms.
    `python_rows=False`: the result's rows are counted by the engine, not turned into tuples."""
    runner = QueryRunner.of_store(store)
    queries: dict[str, dict[str, Any]] = {}
    for name in BUILDERS:
        model = build(name)
        ctx = resolve_variables(model, runner, context_for(now - scenario.span, now), scenario.choose)
        for q in dashboard_queries(model):
            for label, scoped in expansions(q, ctx):
                sql = expand(q.sql, scoped)
                where = f"{name}: {q.where}" + (f" [{label}]" if label else "")
                if sql in queries:
                    queries[sql]["also"].append(where)
                    continue
                _engine(store, sql)  # warm-up
                if python_rows:
                    python_ms, rows = _python_rows(store, sql)
                else:
                    python_ms, rows = float("nan"), int(store.command(f"SELECT count() FROM ({sql})"))
                queries[sql] = {"query": where, "kind": q.kind, "rows": rows, "rows_read": rows_read(store, sql),
                                "rows_selected": rows_selected(store, sql),
                                "python_rows_ms": python_ms, "also": [], "ms": [], "cpu": []}
    for _ in range(repetitions):
        for sql, entry in queries.items():
            wall, cpu = _engine(store, sql)
            entry["ms"].append(wall)
            entry["cpu"].append(cpu)
    out = []
    for entry in queries.values():
        ms, cpu = entry.pop("ms"), entry.pop("cpu")
        out.append({**entry, "p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95), "max_ms": max(ms),
                    "cpu_ms_p50": percentile(cpu, 50)})
    return out


def run(repetitions: int, shape: Shape = Shape(), keep: Path | None = None,
        scenarios: tuple[Scenario, ...] = SCENARIOS, python_rows: bool = True) -> dict[str, Any]:
    directory = keep or Path(tempfile.mkdtemp(prefix="areal-bench-queries-"))
    try:
        built = build_store(directory, shape) if not (directory / "store_ready").exists() else {}
        (directory / "store_ready").write_text("1")
        now = datetime.fromtimestamp(shape.now, timezone.utc)
        with connect(Settings(clickhouse_url=f"chdb://{directory}")) as store:
            assert isinstance(store, DirectStore)
            distinct = int(store.command("SELECT count() FROM v_steps"))
            load_before = os.getloadavg()[0]
            results = {s.label: measure(store, s, repetitions, now, python_rows) for s in scenarios}
            load = (load_before, os.getloadavg()[0])
    finally:
        if keep is None:
            shutil.rmtree(directory, ignore_errors=True)
    figures: dict[str, Any] = {
        **built,
        "steps_rows": distinct,
        "repetitions": repetitions,
        "load_average": load,  # 1-minute load average of the machine at the start and the end of the timing
        "scenarios": results,
    }
    for s in scenarios:
        slowest = max(results[s.label], key=lambda e: e["p95_ms"])
        figures[s.key] = slowest["p95_ms"]
        figures[f"{s.key}_query"] = slowest["query"]
    return figures


def report(figures: dict[str, Any]) -> None:
    print(f"\ndashboard queries on {figures['steps_rows']:,} distinct step rows "
          f"({figures.get('steps_rows_stored', 0):,} stored in {figures.get('steps_parts', '?')} parts; "
          f"generated in {figures.get('generate_s', float('nan')):.0f} s), {figures['repetitions']} repetitions, "
          f"load average {figures['load_average'][0]:.1f} -> {figures['load_average'][1]:.1f} on {os.cpu_count()} cores")
    for label, entries in figures["scenarios"].items():
        print(f"\n  {label}")
        print(f"    {'p50 ms':>8} {'p95 ms':>8} {'CPU ms':>8} {'rows read':>10} {'rows':>7} {'py ms':>7}  query")
        for e in sorted(entries, key=lambda e: -e["p95_ms"]):
            print(f"    {e['p50_ms']:8.1f} {e['p95_ms']:8.1f} {e['cpu_ms_p50']:8.1f} {e['rows_read']:10,d} "
                  f"{e['rows']:7d} {e['python_rows_ms']:7.1f}  {e['query']}")
    for s in SCENARIOS:
        print(f"\n  {s.key} = {figures[s.key]:.1f} ms ({s.label}: {figures[s.key + '_query']})", end="")
    print()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_queries", description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", type=Path, help="generate the store here (or reuse the one there) and keep it")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    figures = run(args.repetitions, keep=args.keep)
    report(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
