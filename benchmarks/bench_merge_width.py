"""What a wider merge (AREAL_CLICKHOUSE_MERGE_SELECTOR_BASE) buys the sink and costs the panels.

    python -m benchmarks.bench_merge_width [--width 20] [--pairs 3] [--panel-runs 8] [--json FILE]

1. The live pipeline, A/B interleaved: `--pairs` pairs, each a fresh store and services with the
   server's own merge width, then with `--width`, through the pipeline benchmark's phases (1, 8 and 64
   ranks, 32,000 step events each, twice). Per variant: the sink's and the machine's CPU per step event
   over all phases and the best phase's events/s, each as the median of the pairs with its runs.
2. The panels, on a store the sink's way: `--panel-runs` runs of 64 ranks, 3,125 steps each, every
   step row inserted in 1,500-row blocks (benchmarks.query_data.generate_in_sink_blocks), the merges
   left to finish, then every dashboard query timed 7 times per scenario (benchmarks.bench_queries),
   once with each merge width. Per variant: the active parts of each wide table, each scenario's
   slowest p95 and the sum of its queries' p50.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks import pipeline
from benchmarks.bench_queries import SCENARIOS, measure
from benchmarks.common import broker, machine, wait_for_merges
from benchmarks.query_data import Shape, generate_in_sink_blocks
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.sinks.migrations import WIDE_MERGE_TABLES, apply_schema
from areal_metrics.sinks.query import DirectStore, Target, connect, open_client
from areal_metrics.sinks.schema import DEFAULT_DATABASE, SchemaOptions

SETTING = "AREAL_CLICKHOUSE_MERGE_SELECTOR_BASE"


def _variants(width: int) -> tuple[tuple[str, int | None], ...]:
    return ("default", None), ("wide", width)


def pipeline_ab(width: int, pairs: int, events: int = 32_000) -> dict[str, Any]:
    os.environ.pop(SETTING, None)  # the default variant is the server's width, whatever this shell sets
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in _variants(width)}
    with broker() as bootstrap:
        for _ in range(pairs):
            for name, value in _variants(width):
                extra = {SETTING: str(value)} if value is not None else {}
                services = pipeline.Services(bootstrap, Path(tempfile.mkdtemp(prefix="areal-bench-width-")),
                                             extra_env=extra)
                services.start()
                try:
                    pipeline.wait_ready(services)
                    phases = [pipeline.pipeline_rate(services, ranks, events) for _ in range(2) for ranks in (1, 8, 64)]
                finally:
                    services.stop()
                total = sum(p["events"] for p in phases)
                runs[name].append({
                    **{f"{k}_cpu_us_per_event": sum(p[f"{k}_cpu_us_per_event"] * p["events"] for p in phases) / total
                       for k in ("sink", "worker", "machine")},
                    "pipeline_events_per_s": max(p["events_per_s"] for p in phases)})
    out: dict[str, Any] = {}
    for name, measured in runs.items():
        for key in measured[0]:
            values = [m[key] for m in measured]
            out[f"{key}_{name}"] = statistics.median(values)
            out[f"{key}_{name}_runs"] = values
    return out


def panels(width: int | None, runs: int, repetitions: int = 7) -> dict[str, Any]:
    shape = Shape(runs=runs, ranks=64, steps=3_125, sink_rows=1_500)
    directory = Path(tempfile.mkdtemp(prefix="areal-bench-width-store-"))
    client = open_client(Target.parse(f"chdb://{directory}"), readonly=False, use_database=False)
    try:
        apply_schema(client, SchemaOptions(merge_selector_base=width))
        t0 = time.perf_counter()
        generate_in_sink_blocks(client, DEFAULT_DATABASE, shape)
        generate_s = time.perf_counter() - t0
        settled = wait_for_merges(client, quiet_s=5, most_s=300)
        client.command("SYSTEM STOP MERGES")  # every repetition reads the same parts
        parts = dict(client.query(f"SELECT table, count() FROM system.parts WHERE database = '{DEFAULT_DATABASE}' "
                                  "AND active GROUP BY table").result_rows)
    finally:
        client.close()
    now = datetime.fromtimestamp(shape.now, timezone.utc)
    with connect(Settings(clickhouse_url=f"chdb://{directory}")) as store:
        assert isinstance(store, DirectStore)
        results = {s.label: measure(store, s, repetitions, now, python_rows=False) for s in SCENARIOS}
    return {"steps_rows": shape.rows, "generate_s": generate_s, "merges_settled": settled,
            "parts": {t: parts.get(t, 0) for t in WIDE_MERGE_TABLES},
            "scenarios": {label: {"p95_ms_max": max(e["p95_ms"] for e in entries),
                                  "p50_ms_sum": sum(e["p50_ms"] for e in entries),
                                  "queries": len(entries)} for label, entries in results.items()}}


def run(width: int = 20, pairs: int = 3, panel_runs: int = 8) -> dict[str, Any]:
    figures: dict[str, Any] = {"machine": machine(), "width": width, "pairs": pairs}
    figures.update(pipeline_ab(width, pairs))
    figures["panels"] = {name: panels(value, panel_runs) for name, value in _variants(width)}
    return figures


def report(f: dict[str, Any]) -> None:
    for name in ("default", "wide"):
        print(f"{name}: sink {f[f'sink_cpu_us_per_event_{name}']:.1f} us/event "
              f"(runs {', '.join(f'{v:.1f}' for v in f[f'sink_cpu_us_per_event_{name}_runs'])}), machine "
              f"{f[f'machine_cpu_us_per_event_{name}']:.1f} us/event, best phase "
              f"{f[f'pipeline_events_per_s_{name}']:,.0f} ev/s")
        p = f["panels"][name]
        print(f"  panels over {p['steps_rows']:,} step rows in sink blocks: parts {p['parts']}")
        for label, s in p["scenarios"].items():
            print(f"    {label}: slowest p95 {s['p95_ms_max']:.0f} ms, sum of p50 {s['p50_ms_sum']:.0f} ms "
                  f"({s['queries']} queries)")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_merge_width", description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=20, help="the wide variant's merge_selector_base")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved pipeline pairs")
    parser.add_argument("--panel-runs", type=int, default=8, help="runs of 64 ranks x 3,125 steps in the panels' store")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures = run(args.width, args.pairs, args.panel_runs)
    report(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
