"""Scale: dashboard panels on step rows from 1,000 ranks, and the stream worker with many live runs.

    python -m benchmarks --scale --json FILE [--scale-rows 100000000] [--scale-sizes 1000000,10000000]

1. Panels. A store of `rows` step rows from `ranks` ranks (default 100M rows from 1,000 ranks:
   10 runs of 10,000 steps, a run a day), generated inside the engine (`benchmarks.query_data`,
   INSERT ... SELECT from numbers(), one block per run: the materialized view of the per-step
   aggregates runs on every block as it does for the sink), then every dashboard query timed
   as `benchmarks.bench_queries` does, over the newest run's last 24 h and over 7 days of all
   runs. `panel_ms_p95_max_100m` is the slowest panel's p95 over both; `panel_steps_rows_100m`
   and `panel_ranks_100m` say the size it was measured at (the key names stay when a machine
   cannot hold 100M rows and a smaller size is measured).
2. Worker. The real stream worker core (`StreamCore.on_batch`: parse, the rank rule, smoothing,
   alerts, encode, state records; no Kafka) in a fresh process, fed steps of `live_runs` runs
   interleaved (every run's ranks of a step, then the next run), 8 ranks each, `world_size` 8:
   CPU microseconds per event (process time) and the process's resident memory at the end.
   1 run and 1,000 runs; `worker_cpu_us_per_event_1_run`, `worker_cpu_us_per_event_1000_runs`,
   `worker_rss_mib_1000_runs`; with `--scale-sizes`, also the sweeps over live runs and over
   ranks per run for the figure (docs/img/scaling.png, `python -m benchmarks.scale_figure`).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

from benchmarks.common import rss_mib
from benchmarks.query_data import Shape

RANKS = 1_000
RUNS = 10


def shape_for(rows: int, ranks: int = RANKS, runs: int = RUNS) -> Shape:
    steps = max(200, rows // (ranks * runs))
    return Shape(runs=runs, ranks=ranks, steps=steps, resume_from=int(steps * 0.6), resumed_steps=min(100, steps // 10),
                 tail_steps=min(120, steps // 10), sink_rows=max(5_000, ranks * 5))


def panels(rows: int, repetitions: int, ranks: int = RANKS) -> dict[str, Any]:
    from benchmarks import bench_queries

    shape = shape_for(rows, ranks)
    # the two ranges the issue names (the 30-minute default view is the quick run's), rows counted by the engine
    figures = bench_queries.run(repetitions, shape, scenarios=bench_queries.SCENARIOS[1:], python_rows=False)
    slowest = max((e for label in ("newest run, last 24 h", "every run, last 7 days")
                   for e in figures["scenarios"][label]), key=lambda e: e["p95_ms"])
    return {"steps_rows": figures["steps_rows"], "ranks": ranks, "runs": shape.runs, "steps_per_run": shape.steps,
            "generate_s": figures.get("generate_s"), "panel_ms_p95_max": slowest["p95_ms"],
            "panel_ms_p95_max_query": slowest["query"], "load_average": figures["load_average"],
            "panel_ms_p95_max_24h": figures["panel_ms_p95_max_24h"],
            "panel_ms_p95_max_7d_all_runs": figures["panel_ms_p95_max_7d_all_runs"],
            "scenarios": figures["scenarios"]}


# --------------------------------------------------------------------------- the worker


def _worker_child(live_runs: int, ranks: int, steps: int, batch: int = 500) -> dict[str, float]:
    """In this (fresh) process: CPU us per event and RSS after feeding the core."""
    from areal_metrics.producers.contract.events import StepEvent
    from areal_metrics.producers.contract.topics import Topics
    from areal_metrics.streams.core.config import StreamsConfig
    from areal_metrics.streams.shell.batch import Input, StreamCore

    topics = Topics("scale.")
    ts = time.time()

    def messages(from_step: int, to_step: int) -> list[Input]:
        out = []
        for step in range(from_step, to_step):
            for r in range(live_runs):
                run = f"run-{r:04d}"
                for rank in range(ranks):
                    ev = StepEvent(run_id=run, node=f"n{rank // 8}", rank=rank, world_size=ranks, step=step, epoch=0,
                                   reward=0.5 + rank / 1000, n_samples=16, throughput=1000.0, ts=ts + step)
                    out.append(Input(topics.steps, r % 16, len(out), run.encode(), ev.to_json(), 1.0))
        return out

    async def send(topic: str, key: bytes, value: bytes):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def go() -> dict[str, float]:
        core = StreamCore(topics=topics, config=StreamsConfig(), table={}, send=send)
        warm = messages(0, 2)  # every run's state made, as in a worker that runs
        for i in range(0, len(warm), batch):
            await core.on_batch(warm[i:i + batch])
        timed = messages(2, 2 + steps)
        cpu = time.process_time()
        for i in range(0, len(timed), batch):
            await core.on_batch(timed[i:i + batch])
        cpu = time.process_time() - cpu
        del timed, warm
        return {"events": live_runs * ranks * steps, "cpu_us_per_event": cpu / (live_runs * ranks * steps) * 1e6,
                "rss_mib": rss_mib(), "state_keys": len(core.table) if hasattr(core, "table") else -1}

    return asyncio.run(go())


def worker(live_runs: int, ranks: int = 8, events: int = 200_000) -> dict[str, float]:
    """One measurement in a fresh process (its RSS is the core's and the interpreter's, nothing else)."""
    steps = max(3, events // (live_runs * ranks))
    code = (f"import json; from benchmarks.bench_scale import _worker_child; "
            f"print(json.dumps(_worker_child({live_runs}, {ranks}, {steps})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {"live_runs": live_runs, "ranks": ranks, **json.loads(out.stdout.strip().splitlines()[-1])}


def run(rows: int, repetitions: int, sizes: list[int], worker_events: int,
        save: Any = None) -> dict[str, Any]:
    """`save(figures)` is called after each phase with what is measured so far (a slow machine
    keeps what it finished)."""
    out: dict[str, Any] = {}
    save = save or (lambda figures: None)
    w1 = worker(1, events=worker_events)
    w1000 = worker(1000, events=worker_events)
    out["worker_cpu_us_per_event_1_run"] = w1["cpu_us_per_event"]
    out["worker_cpu_us_per_event_1000_runs"] = w1000["cpu_us_per_event"]
    out["worker_rss_mib_1_run"] = w1["rss_mib"]
    out["worker_rss_mib_1000_runs"] = w1000["rss_mib"]
    out["worker_kib_per_live_run"] = (w1000["rss_mib"] - w1["rss_mib"]) * 1024 / 999
    out["worker_runs_sweep"] = [w1, *(worker(n, events=worker_events) for n in (10, 100)), w1000] if sizes else []
    out["worker_ranks_sweep"] = [worker(1, ranks=r, events=worker_events) for r in (1, 8, 64, 1024)] if sizes else []
    out["panels"] = []
    save(out)
    for n in sorted({*(n for n in sizes if n < rows), rows}):  # the smaller stores first: the largest is the slowest
        out["panels"].append(panels(n, repetitions))
        big = out["panels"][-1]
        out["panel_ms_p95_max_100m"] = big["panel_ms_p95_max"]  # the largest measured so far
        out["panel_steps_rows_100m"] = big["steps_rows"]
        out["panel_ranks_100m"] = big["ranks"]
        out["load_average_end"] = os.getloadavg()
        save(out)
    return out


def report(figures: dict[str, Any]) -> None:
    print(f"\nscale: slowest panel p95 {figures['panel_ms_p95_max_100m']:.0f} ms at {figures['panel_steps_rows_100m']:,} "
          f"step rows from {figures['panel_ranks_100m']} ranks")
    for p in figures["panels"]:
        print(f"  {p['steps_rows']:>12,} rows: 24 h {p['panel_ms_p95_max_24h']:.0f} ms, 7 d all runs "
              f"{p['panel_ms_p95_max_7d_all_runs']:.0f} ms (slowest: {p['panel_ms_p95_max_query']}), "
              f"generated in {p['generate_s']:.0f} s")
    print(f"  worker: {figures['worker_cpu_us_per_event_1_run']:.1f} us/event at 1 run, "
          f"{figures['worker_cpu_us_per_event_1000_runs']:.1f} at 1,000 runs x 8 ranks; RSS "
          f"{figures['worker_rss_mib_1000_runs']:.0f} MiB ({figures['worker_kib_per_live_run']:.1f} KiB per live run)")
