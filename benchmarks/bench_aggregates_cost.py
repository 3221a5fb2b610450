"""What the insert-time aggregates cost the sink: CPU per step row inserted with neither, either or
both of the materialized views that fill `step_aggregates` and `rank_aggregates` (the latter with the
coarse per-rank level it feeds, or without it: `fine_ranks`).

    python -m benchmarks.bench_aggregates_cost [--rows 100000] [--repeats 3] [--block 5000] [--json FILE]

Each measurement in a fresh process and a fresh embedded store: the sink's own insert path
(`sinks.writer.insert_rows`, blocks of `--block` rows with their tokens: building the columns in
Python and the engine's insert, the materialized views included when present), `--runs` runs of 8 ranks,
12 typed columns and 2 metrics per row. Reported: the median of `--repeats` runs of each, CPU
(user + system of the process) per row; and what analysing each view's query costs (`plan_cpu_ms_*`),
which an insert pays once per block.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = '''
import json, resource, sys
from areal_metrics.producers.contract.events import StepEvent
from areal_metrics.sinks.migrations import apply_schema
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.schema import PARTITION_BY, SchemaOptions
from areal_metrics.sinks import rank_aggregates, step_means
from areal_metrics.sinks.writer import insert_rows
path, views, n, block, runs, unpartitioned = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                            int(sys.argv[5]), sys.argv[6] == "1")
c = open_client(Target.parse(f"chdb://{path}"), readonly=False, use_database=False)
o = SchemaOptions()
apply_schema(c, o)
if unpartitioned:  # the aggregate tables in one partition (tried as a migration 12, and not kept: PERFORMANCE.md)
    for drops, create, view in ((step_means.drop_statements(o), step_means.aggregates_table_sql(o),
                                 step_means.aggregates_mv_sql(o)),
                                (rank_aggregates.drop_statements(o), rank_aggregates.table_sql(o),
                                 rank_aggregates.mv_sql(o))):
        one_partition = create.replace(f"PARTITION BY {PARTITION_BY}\\n", "")
        assert one_partition != create
        for stmt in [*drops, one_partition, view]:
            c.command(stmt)
    for stmt in rank_aggregates.coarse_create_statements(o):  # dropped with the fine level
        c.command(stmt)
# the materialized views only: inserts no longer reach their tables ("fine_ranks": the per-rank coarse level's off)
if views in ("none", "ranks"):
    c.command(step_means.drop_statements(o)[0])
if views in ("none", "steps", "fine_ranks"):
    c.command(f"DROP VIEW {o.database}.{rank_aggregates.RANK_AGGREGATES_COARSE_MV}")
if views in ("none", "steps"):
    c.command(f"DROP VIEW {o.database}.{rank_aggregates.RANK_AGGREGATES_MV}")
ev = [StepEvent(run_id=f"r{i % runs}", step=i // (8 * runs), rank=(i // runs) % 8, world_size=8, epoch=0, reward=0.5, kl=0.01, entropy=1.0,
                loss=0.3, lr=1e-6, grad_norm=1.0, tokens=1000, throughput=1e3, latency_ms=10.0, n_samples=16,
                metrics={"a": 1.0, "b": 2.0}, ts=1.8e9 + i) for i in range(n)]
rows = [Located(e, "areal.steps", 0, i) for i, e in enumerate(ev)]
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
start = cpu()
for i in range(0, n, block):
    insert_rows(c, "areal", rows[i:i + block], f"t{i}")
print(json.dumps((cpu() - start) / n * 1e6))
'''


PLAN_CHILD = '''
import json, resource, sys
from areal_metrics.sinks.migrations import apply_schema
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.schema import SchemaOptions
from areal_metrics.sinks import rank_aggregates, step_means
c = open_client(Target.parse(f"chdb://{sys.argv[1]}"), readonly=False, use_database=False)
apply_schema(c)
o = SchemaOptions()
def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
out = {}
for name, sql in (("steps", step_means._select_from_steps(o)), ("ranks", rank_aggregates._select_from_steps(o)),
                  ("select_1", "SELECT 1")):
    for _ in range(3):
        c.query(sql)
    start = cpu()
    for _ in range(20):
        c.query(sql)
    out[f"plan_cpu_ms_{name}"] = (cpu() - start) / 20 * 1e3
print(json.dumps(out))
'''

# which materialized views stay: neither, either, both; and both without the per-rank coarse level (which the
# per-rank view's inserts fill: "ranks" and "both" include it)
VIEWS = ("none", "steps", "ranks", "both", "fine_ranks")


def once(views: str, rows: int, block: int, runs: int, unpartitioned: bool) -> float:
    with tempfile.TemporaryDirectory(prefix="areal-bench-agg-") as d:
        out = subprocess.run([sys.executable, "-c", CHILD, str(Path(d) / "ch"), views, str(rows), str(block), str(runs),
                              "1" if unpartitioned else "0"],
                             capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def plan_cost() -> dict[str, float]:
    """CPU of each view's SELECT over the empty `steps` table: what an insert pays per block before a row
    is aggregated (ClickHouse builds a materialized view's query anew for every INSERT, and the sink inserts a block at a time)."""
    with tempfile.TemporaryDirectory(prefix="areal-bench-agg-") as d:
        out = subprocess.run([sys.executable, "-c", PLAN_CHILD, str(Path(d) / "ch")], capture_output=True, text=True,
                             check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(rows: int = 100_000, repeats: int = 3, block: int = 5_000, runs: int = 4,
        unpartitioned: bool = False) -> dict[str, float | list[float]]:
    figures: dict[str, list[float]] = {v: [] for v in VIEWS}
    for _ in range(repeats):  # alternated: a change of the machine's load falls on each
        for views in VIEWS:
            figures[views].append(once(views, rows, block, runs, unpartitioned))
    out: dict[str, float | list[float]] = {"block_rows": block, "runs": runs, "unpartitioned_aggregates": unpartitioned}
    for views, values in figures.items():
        out[f"sink_insert_cpu_us_per_row_views_{views}"] = statistics.median(values)
        out[f"sink_insert_cpu_us_per_row_views_{views}_runs"] = values
    return {**out, **plan_cost()}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_aggregates_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block", type=int, default=5_000, help="rows per inserted block")
    parser.add_argument("--runs", type=int, default=4, help="runs of 8 ranks whose steps each block holds")
    parser.add_argument("--unpartitioned-aggregates", action="store_true",
                        help="the aggregate tables in one partition instead of by run bucket")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures = run(args.rows, args.repeats, args.block, args.runs, args.unpartitioned_aggregates)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
