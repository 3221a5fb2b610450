"""How the input messages reach the batcher, with the skipped-input guard.

The consumer (areal_metrics.streams.shell.faust_internals) hands over each fetch's input messages as one
list (`deliver`). A real consumer's messages pass `areal_metrics.streams.shell.resync.InputGuard` on
arrival: a partition that jumped past offsets it never delivered, or that fetched
messages but stopped delivering them, is sought back and read again (what a batch
takes does not matter to the guard). A worker built with a test's transport has no
consumer: `InputFeed(app, guard=None, ...)` then only forwards.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import faust
from faust.types import TP

from areal_metrics.streams.shell.batch import Input
from areal_metrics.streams.shell.batcher import Batcher
from areal_metrics.streams.shell.resync import InputGuard

log = logging.getLogger("streams")


class InputFeed:
    def __init__(self, app: faust.App, guard: InputGuard | None, inputs: tuple[str, ...]) -> None:
        self.app = app
        self.guard = guard
        self.inputs = inputs  # the topics read for the core (not the ticks)
        self.batcher: Batcher | None = None  # set once built (the batcher asks `backlog`)

    def backlog(self) -> bool:
        """More input in Kafka than the agents have read (the high-water marks of the last fetch)."""
        assert self.guard is not None
        for (topic, partition), last in list(self.guard.last.items()):
            try:
                high = self.app.consumer.highwater(TP(topic, partition))
            except Exception:  # noqa: BLE001 - a partition being reassigned
                continue
            if high is not None and high > last + 1:
                return True
        return False

    async def seek(self, topic: str, partition: int, offset: int) -> None:
        await self.app.consumer.seek(TP(topic, partition), offset)

    async def deliver(self, messages: list[Any]) -> None:
        """A fetch's input messages (areal_metrics.streams.shell.faust_internals), in order, to the batcher; each is
        acknowledged (its Message is the token) once processed, or at once when the guard
        skips it."""
        assert self.batcher is not None
        guard, add_many, ack = self.guard, self.batcher.add_many, self.batcher.ack
        now = time.monotonic()
        entries: list[tuple[Input, Any]] = []
        for m in messages:
            if guard is not None:
                verdict, target = guard.on_message((m.topic, m.partition), m.offset, now)
                if verdict != "process":
                    await add_many(entries)  # what came before it, first
                    entries = []
                    if verdict == "seek" and target is not None:
                        log.warning("%s/%s jumped to offset %s; re-reading from %s", m.topic, m.partition,
                                    m.offset, target)
                        await self.seek(m.topic, m.partition, target)
                    await ack([m])
                    continue
            entries.append((Input(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp), m))
        await add_many(entries)

    async def unstick(self) -> None:
        """Partitions whose fetched messages stopped coming: seek back (areal_metrics.streams.shell.resync)."""
        if self.guard is None or self.batcher is None:
            return
        now = time.monotonic()
        if self.batcher.paused():  # the agents stopped reading on purpose: a quiet spell starts now
            self.guard.touch(now)
            return
        consumer = self.app.consumer
        for tp in list(consumer.assignment()):
            if tp.topic not in self.inputs:
                continue
            try:
                position = await consumer.position(tp)
            except Exception:  # noqa: BLE001 - a partition being reassigned: next time
                continue
            # Faust keeps a committed offset of 0 as None; the worker commits start offsets
            # for every partition before it starts, so None means 0 here.
            committed = getattr(consumer, "_committed_offset", {}).get(tp) or 0
            target = self.guard.stuck((tp.topic, tp.partition), position, now, committed)
            if target is not None:
                log.warning("%s/%s fetched up to %s but delivers nothing; re-reading from %s",
                            tp.topic, tp.partition, position, target)
                await self.seek(tp.topic, tp.partition, target)

    def forget(self) -> None:
        if self.guard is not None:
            self.guard.forget()
