"""areal_metrics.streams.shell.batcher: messages in, batches through the core in arrival order, then acknowledged."""

from __future__ import annotations

import asyncio
from typing import Any

from areal_metrics.streams.shell.batch import Input
from areal_metrics.streams.shell.batcher import Batcher, Tick


class FakeCore:
    """Records what the batcher hands over (only on_batch and on_tick are used)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def on_batch(self, messages: list[Input]) -> None:
        self.calls.append(("batch", [m.offset for m in messages]))

    async def on_tick(self, partition: int) -> None:
        self.calls.append(("tick", partition))


def test_a_fetch_goes_through_in_order_with_ticks_in_place_and_is_acked_once_processed() -> None:
    async def go() -> tuple[list[tuple[str, Any]], list[list[Any]]]:
        core = FakeCore()
        acks: list[list[Any]] = []

        async def ack(tokens: list[Any]) -> None:
            assert core.calls, "acknowledged before it was processed"
            acks.append(list(tokens))

        batcher = Batcher(core, ack, max_batch=100, linger_s=0.01)  # type: ignore[arg-type]
        fetch = [(Input("steps", 0, o, b"r", b"{}"), f"m{o}") for o in range(3)]
        await batcher.add_many(fetch)
        await batcher.add(Tick(0), "t0")
        await batcher.add_many([(Input("steps", 0, 3, b"r", b"{}"), "m3")])
        await batcher.add_many([])
        await batcher.settled()
        return core.calls, acks

    calls, acks = asyncio.run(go())
    assert calls == [("batch", [0, 1, 2]), ("tick", 0), ("batch", [3])]
    assert acks == [["m0", "m1", "m2", "t0", "m3"]]  # one call per batch, in arrival order
