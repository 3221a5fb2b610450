"""What a step whose ranks report one at a time costs the stream worker's state and changelog.

    python -m benchmarks.bench_straggling_ranks [--ranks 1024] [--steps 3] [--batch 1]

The real worker core (`StreamCore.on_batch`, as benchmarks.bench_scale), in this process, with a
table that stands for Faust's (its changelog records go to the `changelog` function, as in the
worker): one run, `steps` steps of `ranks` ranks (world_size = ranks), the ranks' reports of a
step arriving `batch` per batch (1: every report its own batch, the straggler's case), steps one
after the other. Counted: the changelog's records and bytes (keys and values; tombstones count
their key), CPU per event (process time, whole core) and the CPU inside the state store's
`save` (the state's encoding and its records). A state store that rewrote a waiting step's
whole record per report wrote 1+2+...+ranks reports per step (quadratic); one that writes
each batch's new reports writes ~ranks. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any


def measure(ranks: int, steps: int, batch: int) -> dict[str, Any]:
    from areal_metrics.producers.contract.events import StepEvent
    from areal_metrics.producers.contract.topics import Topics
    from areal_metrics.streams.core.config import StreamsConfig
    from areal_metrics.streams.shell.batch import Input, StreamCore

    topics = Topics("strag.")
    t0 = time.time()

    class Table:  # what the store uses of Faust's table
        def __init__(self) -> None:
            self.data: dict[bytes, bytes] = {}

        def send_changelog(self, *a: Any, **kw: Any) -> None:  # unused: the records go to `changelog`
            raise AssertionError("direct changelog expected")

    counted = {"records": 0, "bytes": 0, "tombstones": 0}

    async def changelog(records: list[tuple[int, bytes, bytes | None]]) -> None:
        counted["records"] += len(records)
        counted["tombstones"] += sum(v is None for _, _, v in records)
        counted["bytes"] += sum(len(k) + (len(v) if v is not None else 0) for _, k, v in records)

    async def send(topic: str, key: bytes, value: bytes) -> Any:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    core = StreamCore(topics=topics, config=StreamsConfig(), table=Table(), send=send, changelog=changelog,
                      clock=lambda: t0)
    save_cpu = [0.0]
    save = core.store.save

    def timed_save(state: Any) -> None:
        c = time.process_time()
        save(state)
        save_cpu[0] += time.process_time() - c

    core.store.save = timed_save  # type: ignore[method-assign]

    def inputs(step: int) -> list[Input]:
        return [Input(topics.steps, 0, step * ranks + rank, b"run",
                      StepEvent(run_id="run", node=f"n{rank // 8}", rank=rank, world_size=ranks, step=step, epoch=0,
                                reward=0.5 + rank / 1000, n_samples=16, throughput=1000.0, ts=t0 + step).to_json(), 1.0)
                for rank in range(ranks)]

    async def go() -> dict[str, Any]:
        messages = [m for s in range(steps) for m in inputs(s)]
        cpu = time.process_time()
        for i in range(0, len(messages), batch):
            await core.on_batch(messages[i:i + batch])
        cpu = time.process_time() - cpu
        events = ranks * steps
        assert not core.cache["run"].ranks.pending, "every step completes"
        return {"ranks": ranks, "steps": steps, "batch": batch, "events": events,
                "changelog_records": counted["records"], "changelog_tombstones": counted["tombstones"],
                "changelog_bytes": counted["bytes"], "changelog_bytes_per_event": counted["bytes"] / events,
                "cpu_us_per_event": cpu / events * 1e6, "save_cpu_us_per_event": save_cpu[0] / events * 1e6,
                "table_records_at_end": len(core.table.data)}

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(measure(args.ranks, args.steps, args.batch)))


if __name__ == "__main__":
    main()
