"""Input messages for a worker built without a broker: the same hand-over the consumer makes.

`RecordingTransport(send)` is the transport of such a worker (`build_worker(transport=...)`).
`inputs(worker, topic)` gives an object whose `put(value, key=, headers=)` turns each value
into a Faust `Message` (offsets counting up per topic) and hands it to the worker's
InputFeed, as areal_metrics.streams.shell.faust_internals does with a fetch. `worker.settled()` then waits for
the batcher.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from faust.types import TP, Message

from areal_metrics.streams.shell.app import StreamWorker
from areal_metrics.streams.shell.batch import SendFn
from areal_metrics.streams.shell.input_feed import InputFeed
from areal_metrics.streams.shell.resync import InputGuard


class RecordingTransport:
    """A worker's transport without a broker (streams.shell.app.Transport): every output goes through
    `send` one message at a time (a test's recorder); there is no consumer, so no input guard, no
    offsets to commit, no backlog to ask and no worker to stop on a crash."""

    reroutes = False  # its outputs never reach a broker: a copy sent on would not come back

    def __init__(self, send: SendFn) -> None:
        self.send = send

    def outputs(self, app: Any, runs: Any) -> dict[str, Any]:
        return {"send": self.send}

    def input_guard(self) -> InputGuard | None:
        return None

    def ack_inputs(self, app: Any, inputs: list[Any]) -> None:
        pass

    def batcher_hooks(self, app: Any, feed: InputFeed) -> dict[str, Any]:
        return {}


class FeedInput:
    def __init__(self, worker: StreamWorker, topic: str) -> None:
        self.worker, self.topic = worker, topic
        self.offsets = itertools.count()

    async def put(self, value: bytes | None, *, key: bytes | None = None, headers: Any = None,
                  partition: int = 0) -> None:
        offset = next(self.offsets)
        message = Message(self.topic, partition, offset, time.time(), 0, headers, key, value, None, tp=TP(self.topic, partition))
        await self.worker.feed.deliver([message])


@asynccontextmanager
async def inputs(worker: StreamWorker, topic: str) -> AsyncIterator[FeedInput]:
    yield FeedInput(worker, topic)
