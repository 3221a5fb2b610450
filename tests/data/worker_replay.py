"""Today's stream worker logic over recorded trainer events, as a running worker would meet them.

`Replay` is `areal_metrics.streams.shell.batch.StreamCore` with a send that records what it emits and a clock the
caller sets: `advance(ts)` moves the clock to an event's time and, meanwhile, ticks every
partition once a second (the worker's timer); `put` hands over one input message at the next
offset of its partition; `time_out(s)` lets `s` seconds pass after the last event, so open
rounds and waiting steps time out. Used by make_demo_events.py and make_workload_events.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from areal_metrics.producers.contract.topics import Topics
from areal_metrics.streams.shell.batch import StreamCore
from areal_metrics.streams.core.config import StreamsConfig


class Replay:
    def __init__(self, config: StreamsConfig, partitions: Iterable[int]) -> None:
        self.topics = Topics("areal.")
        self.now = 0.0
        self.emitted: list[bytes] = []
        self.core = StreamCore(topics=self.topics, config=config, table={}, send=self._send, clock=lambda: self.now)
        self.offsets = {p: 0 for p in partitions}
        self._next_tick: float | None = None

    async def _send(self, topic: str, key: bytes, value: bytes) -> asyncio.Future[None]:
        self.emitted.append(value)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    async def advance(self, ts: float) -> None:
        self.now = ts
        if self._next_tick is None:
            self._next_tick = ts + 1
        while self._next_tick <= ts:
            for p in self.offsets:
                await self.core.on_tick(p)
            self._next_tick += 1

    async def put(self, topic: str, partition: int, key: bytes, raw: bytes, timestamp: float | None = None) -> None:
        await self.core.on_input(topic, partition, self.offsets[partition], key, raw, timestamp)
        self.offsets[partition] += 1

    async def time_out(self, seconds: float) -> None:
        self.now += seconds
        for p in self.offsets:
            await self.core.on_tick(p)
