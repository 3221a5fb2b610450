"""The efficiency board's per-rank panels on `v_rank_buckets_of(runs)` against `v_rank_buckets`.

    python -m benchmarks.bench_rank_views [--rows 2000000] [--repeats 7]

One store of the scale run's shape (`benchmarks.bench_scale.shape_for`: 1,000 ranks), the
'Throughput per node and rank' and 'Nodes and ranks' SQL expanded as Grafana expands it for the
two ranges of `benchmarks.bench_queries.SCENARIOS` (newest run, 24 h; every run, 7 days), then
the same SQL with `v_rank_buckets_of(runs = [...])` replaced by `v_rank_buckets`; the two run
in turn. Reported: the rows the engine counted (`bench_queries.rows_selected`) and the median
CPU of `--repeats` runs of each.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from areal_metrics.grafana.catalog import build
from areal_metrics.grafana.macros import expand
from areal_metrics.grafana.queries import QueryRunner, context_for, dashboard_queries, resolve_variables
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.sinks.query import connect
from benchmarks import bench_queries
from benchmarks.bench_scale import shape_for

PANELS = ("Throughput per node and rank", "Nodes and ranks")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_rank_views", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    shape = shape_for(args.rows)
    directory = Path(tempfile.mkdtemp(prefix="areal-bench-rank-views-"))
    try:
        bench_queries.build_store(directory, shape)
        now = datetime.fromtimestamp(shape.now, timezone.utc)
        with connect(Settings(clickhouse_url=f"chdb://{directory}")) as store:
            model = build("efficiency")
            for scenario in bench_queries.SCENARIOS[1:]:
                ctx = resolve_variables(model, QueryRunner.of_store(store), context_for(now - scenario.span, now),
                                        scenario.choose)
                for q in dashboard_queries(model):
                    if not any(f"'{p}'" in q.where for p in PANELS):
                        continue
                    of_runs = expand(q.sql, ctx)
                    plain = re.sub(r"v_rank_buckets_of\(runs = \[[^\]]*\]\)", "v_rank_buckets", of_runs)
                    cpu: dict[str, list[float]] = {"of": [], "plain": []}
                    for _ in range(args.repeats):
                        for key, sql in (("of", of_runs), ("plain", plain)):
                            cpu[key].append(bench_queries._engine(store, sql)[1])
                    print(f"{scenario.label} | {q.where}: rows {bench_queries.rows_selected(store, of_runs):,} / "
                          f"{bench_queries.rows_selected(store, plain):,}, CPU {statistics.median(cpu['of']):.0f} / "
                          f"{statistics.median(cpu['plain']):.0f} ms (v_rank_buckets_of / v_rank_buckets)")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
