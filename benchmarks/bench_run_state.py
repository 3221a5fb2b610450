"""What one live run costs the stream worker, and that a run that leaves gives it back.

    python -m benchmarks.bench_run_state [--runs 1000] [--ranks 8] [--steps 3]

The real worker core (`StreamCore.on_batch`, a dict as its table, as benchmarks.bench_scale),
in this process: `runs` runs of `ranks` ranks (world_size = ranks), `steps` steps each, the
default thresholds. Python's heap is traced (tracemalloc) from after a warm-up run:
`bytes_per_run` is the growth per live run (decoded state, its table records, the worker's
index of them, its place in the line of live runs); `table_bytes_per_run` the table's keys
and values alone (what the changelog topic holds per run). Then the clock moves past
AREAL_WORKER_RUN_IDLE_S and one tick raises the runs' `stalled` alerts and evicts them:
`bytes_per_run_after_eviction` is what is left per run (the dicts' room: Python's dicts do not
shrink), `bytes_per_run_after_a_second_wave` the same after as many new runs came and left
again (no more than after the first: the room is used again). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time
import tracemalloc
from typing import Any

from benchmarks.common import rss_mib


def measure(runs: int, ranks: int, steps: int) -> dict[str, Any]:
    from areal_metrics.producers.contract.events import StepEvent
    from areal_metrics.producers.contract.topics import Topics
    from areal_metrics.streams.core.config import StreamsConfig
    from areal_metrics.streams.shell.batch import Input, StreamCore

    topics = Topics("cost.")
    clock = [time.time()]
    table: dict[bytes, bytes] = {}

    async def send(topic: str, key: bytes, value: bytes) -> Any:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    core = StreamCore(topics=topics, config=StreamsConfig(), table=table, send=send, clock=lambda: clock[0],
                      max_runs=runs + 1)

    def batch(names: list[str], step: int) -> list[Input]:
        return [Input(topics.steps, 0, i, name.encode(),
                      StepEvent(run_id=name, node=f"n{rank}", rank=rank, world_size=ranks, step=step, epoch=0,
                                reward=0.5 + rank / 1000, n_samples=16, throughput=1000.0,
                                ts=clock[0] + step).to_json(), 1.0)
                for i, (name, rank) in enumerate((n, r) for n in names for r in range(ranks))]

    async def feed(names: list[str]) -> None:
        for step in range(steps):
            for i in range(0, len(names), 50):
                await core.on_batch(batch(names[i:i + 50], step))

    async def go() -> dict[str, Any]:
        await feed(["warm-up"])
        await core.on_tick(0)
        gc.collect()
        tracemalloc.start()
        base, rss0 = tracemalloc.get_traced_memory()[0], rss_mib()
        await feed([f"run-{r:05d}" for r in range(runs)])
        gc.collect()
        live = tracemalloc.get_traced_memory()[0]
        table_bytes = sum(len(k) + len(v) for k, v in table.items())
        records = len(table)
        rss_live = rss_mib()
        clock[0] += core.run_idle_s + 1  # type: ignore[operator]
        await core.on_tick(0)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        await feed([f"next-{r:05d}" for r in range(runs)])  # as many new runs again, then evicted too
        clock[0] += core.run_idle_s + 1  # type: ignore[operator]
        await core.on_tick(0)
        gc.collect()
        second = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return {"runs": runs, "ranks": ranks, "steps": steps, "bytes_per_run": (live - base) / runs,
                "table_bytes_per_run": table_bytes / (runs + 1), "table_records_per_run": records / (runs + 1),
                "bytes_per_run_after_eviction": (after - base) / runs,
                "bytes_per_run_after_a_second_wave": (second - base) / runs, "live_runs_after": core.live_runs,
                "evicted": core.stats["evicted"], "rss_mib_live": rss_live, "rss_mib_before": rss0,
                "rss_mib_after_eviction": rss_mib()}

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(measure(args.runs, args.ranks, args.steps)))


if __name__ == "__main__":
    main()
