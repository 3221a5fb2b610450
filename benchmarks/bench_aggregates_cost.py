"""What the insert-time aggregates cost the sink: CPU per step row inserted with neither, either or
both of the materialized views that fill `step_aggregates` and `rank_aggregates` (the latter with the
coarse per-rank level it feeds, or without it: `fine_ranks`).

    python -m benchmarks.bench_aggregates_cost [--rows 100000] [--repeats 3] [--block 5000] [--runs 4]
                                               [--ranks 8] [--merge-setting NAME=VALUE ...] [--json FILE]

Each measurement in a fresh process and a fresh embedded store: the sink's own insert path
(`sinks.writer.insert_rows`, blocks of `--block` rows with their tokens: building the columns in
Python and the engine's insert, the materialized views included when present), `--runs` runs of
`--ranks` ranks, 12 typed columns and 2 metrics per row. Reported: the median of `--repeats` runs of
each, CPU (user + system of the process) per row while the blocks go in
(`sink_insert_cpu_us_per_row_views_*`); of that, the inserting thread's (`..._inserting_thread`: the
rest is the engine's other threads, mostly its background merges, which run beside the inserts:
with merges stopped they took about 1.5 us a row in one ad hoc run); the process's CPU once the
merges the inserts started have finished too (`..._with_merges`); the rows the merges rewrote per
row inserted into any table (`merged_rows_per_row_views_*`, from `system.events`); and what analysing
each view's query costs (`plan_cpu_ms_*`), which an insert pays once per block.

`--merge-setting NAME=VALUE` (repeatable) sets a MergeTree setting on `steps` and the aggregate
tables before the inserts (`ALTER TABLE ... MODIFY SETTING`), to measure a merge policy the schema
does not ship, e.g. `merge_selector_base=20`.
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
from benchmarks.common import wait_for_merges
from areal_metrics.producers.contract.events import StepEvent
from areal_metrics.sinks.migrations import WIDE_MERGE_TABLES, apply_schema
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.schema import PARTITION_BY, SchemaOptions
from areal_metrics.sinks import rank_aggregates, step_means
from areal_metrics.sinks.writer import insert_rows
path, views, n, block, runs, unpartitioned, ranks = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                                   int(sys.argv[5]), sys.argv[6] == "1", int(sys.argv[7]))
merge_settings = json.loads(sys.argv[8])
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
for table in WIDE_MERGE_TABLES:
    for setting in merge_settings:
        c.command(f"ALTER TABLE {o.database}.{table} MODIFY SETTING {setting}")
ev = [StepEvent(run_id=f"r{i % runs}", step=i // (ranks * runs), rank=(i // runs) % ranks, world_size=ranks, epoch=0, reward=0.5, kl=0.01, entropy=1.0,
                loss=0.3, lr=1e-6, grad_norm=1.0, tokens=1000, throughput=1e3, latency_ms=10.0, n_samples=16,
                metrics={"a": 1.0, "b": 2.0}, ts=1.8e9 + i) for i in range(n)]
rows = [Located(e, "areal.steps", 0, i) for i, e in enumerate(ev)]
def cpu(who=resource.RUSAGE_SELF):
    u = resource.getrusage(who)
    return u.ru_utime + u.ru_stime
def counted():
    return dict(c.query("SELECT event, value FROM system.events WHERE event IN ('MergedRows', 'InsertedRows')").result_rows)
before = counted()
start, start_thread = cpu(), cpu(resource.RUSAGE_THREAD)
for i in range(0, n, block):
    insert_rows(c, "areal", rows[i:i + block], f"t{i}")
during, thread = cpu() - start, cpu(resource.RUSAGE_THREAD) - start_thread
settled = wait_for_merges(c, quiet_s=3, most_s=60)  # the merges these inserts set off
# (the waiting loop's own queries cost a few ms over the whole wait: not a merge's, and counted with them)
after = counted()
print(json.dumps({"process": during / n * 1e6, "thread": thread / n * 1e6, "with_merges": (cpu() - start) / n * 1e6,
                  "merges_settled": settled,
                  "merged_rows_per_row": (after.get("MergedRows", 0) - before.get("MergedRows", 0))
                                         / max(1, after.get("InsertedRows", 0) - before.get("InsertedRows", 0))}))
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


def once(views: str, rows: int, block: int, runs: int, unpartitioned: bool, ranks: int = 8,
         merge_settings: tuple[str, ...] = ()) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="areal-bench-agg-") as d:
        out = subprocess.run([sys.executable, "-c", CHILD, str(Path(d) / "ch"), views, str(rows), str(block), str(runs),
                              "1" if unpartitioned else "0", str(ranks), json.dumps(list(merge_settings))],
                             capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def plan_cost() -> dict[str, float]:
    """CPU of each view's SELECT over the empty `steps` table: what an insert pays per block before a row
    is aggregated (ClickHouse builds a materialized view's query anew for every INSERT, and the sink inserts a block at a time)."""
    with tempfile.TemporaryDirectory(prefix="areal-bench-agg-") as d:
        out = subprocess.run([sys.executable, "-c", PLAN_CHILD, str(Path(d) / "ch")], capture_output=True, text=True,
                             check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# each child's figure -> its key in the JSON ("{views}" is the views measured)
FIGURES = {"process": "sink_insert_cpu_us_per_row_views_{views}",
           "thread": "sink_insert_cpu_us_per_row_views_{views}_inserting_thread",
           "with_merges": "sink_insert_cpu_us_per_row_views_{views}_with_merges",
           "merged_rows_per_row": "merged_rows_per_row_views_{views}",
           "merges_settled": "merges_settled_views_{views}"}  # False: still merging after 60 s (_with_merges is short)


def run(rows: int = 100_000, repeats: int = 3, block: int = 5_000, runs: int = 4, unpartitioned: bool = False,
        ranks: int = 8, merge_settings: tuple[str, ...] = (),
        views_measured: tuple[str, ...] = VIEWS) -> dict[str, object]:
    figures: dict[str, list[dict[str, float]]] = {v: [] for v in views_measured}
    for _ in range(repeats):  # alternated: a change of the machine's load falls on each
        for views in views_measured:
            figures[views].append(once(views, rows, block, runs, unpartitioned, ranks, merge_settings))
    out: dict[str, object] = {"block_rows": block, "runs": runs, "ranks": ranks, "rows": rows,
                              "unpartitioned_aggregates": unpartitioned, "merge_settings": list(merge_settings)}
    for views, measured in figures.items():
        for figure, key in FIGURES.items():
            values = [m[figure] for m in measured]
            if figure == "merges_settled":
                out[key.format(views=views)] = all(values)
                continue
            out[key.format(views=views)] = statistics.median(values)
            out[key.format(views=views) + "_runs"] = values
    return {**out, **plan_cost()}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_aggregates_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block", type=int, default=5_000, help="rows per inserted block")
    parser.add_argument("--runs", type=int, default=4, help="runs (of --ranks ranks) whose steps each block holds")
    parser.add_argument("--ranks", type=int, default=8, help="ranks of each run (1: a row per step)")
    parser.add_argument("--unpartitioned-aggregates", action="store_true",
                        help="the aggregate tables in one partition instead of by run bucket")
    parser.add_argument("--merge-setting", action="append", default=[], metavar="NAME=VALUE",
                        help="a MergeTree setting for steps and the aggregate tables (repeatable)")
    parser.add_argument("--views", default=",".join(VIEWS), help=f"which to measure, of {', '.join(VIEWS)}")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    views = tuple(v for v in args.views.split(",") if v)
    if not views or set(views) - set(VIEWS):
        parser.error(f"--views: of {', '.join(VIEWS)}")
    figures = run(args.rows, args.repeats, args.block, args.runs, args.unpartitioned_aggregates, args.ranks,
                  tuple(args.merge_setting), views)
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
