"""Messages gathered into batches for StreamCore: the queue between Faust's agents and the core.

Agents hand over each message as it arrives (`add`, with a token the shell acknowledges it
by); one flusher task takes what waits, at most `max_batch` at a time, once the first has
waited `linger_s` (at once when a batch is full), and runs it through the core: input
messages in arrival order, ticks in their place. Every message is acknowledged only after
its batch is processed (outputs delivered, state saved), so a crash reads it again.

Under load the batches grow by themselves: what arrives while one batch is processed is
the next. At a trickle a message waits at most `linger_s`. While `backlog()` says more
input is in Kafka than the agents have read (a worker catching up), the batch waits for
it, up to `max_batch` messages or `max_linger_s`: the agents and the core share one
thread, so a batch cut at `linger_s` would hold only what the agents read meanwhile. When `max_pending` messages
wait, `add` waits too (Faust's own buffers then hold the rest); `paused()` tells the
skipped-input guard that the agents stopped reading on purpose.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from areal_metrics.producers.runtime.poison import OK, POISON, CrashGuard, crash_now, spans
from areal_metrics.streams.shell.batch import Input, StreamCore
from areal_metrics.streams.shell.record_batches import DeliveryFailed

log = logging.getLogger("streams")


@dataclass(frozen=True, slots=True)
class Tick:
    partition: int


@dataclass
class Batcher:
    core: StreamCore
    ack: Callable[[list[Any]], Awaitable[Any]]  # acknowledges messages by the tokens `add` got, in order
    max_batch: int = 2000
    linger_s: float = 0.005
    max_pending: int = 8000
    max_linger_s: float = 0.1
    backlog: Callable[[], bool] | None = None  # True: more input waits in Kafka
    on_crash: Callable[[BaseException], Any] | None = None
    # a crash never loops (producers/runtime/poison.py): the positions in flight, the suspects
    guard: CrashGuard | None = None
    crash_marker: bytes | None = None  # the test hook (AREAL_TEST_CRASH_ON)
    stats: dict[str, int] = field(default_factory=lambda: {"batches": 0, "messages": 0, "largest": 0})

    def __post_init__(self) -> None:
        self.pending: list[tuple[Input | Tick, Any]] = []
        self._waiting = 0  # agents waiting for room now
        self._was_blocked = False  # ... or since the last `paused()`
        self._first_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._room = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._crashed: BaseException | None = None

    async def add(self, item: Input | Tick, token: Any) -> None:
        await self.add_many([(item, token)])

    async def add_many(self, entries: list[tuple[Input | Tick, Any]]) -> None:
        """Messages in arrival order, with their tokens (a fetch's at once: the wait for room
        is per call, so `pending` may pass `max_pending` by one call's messages). Nothing more after a
        crash, while the process stops: a batch begun then would write over the crashed batch's positions
        in flight (and its end clear them), so the crash would count against no message."""
        if not entries or self._crashed is not None:
            return
        while len(self.pending) >= self.max_pending:
            self._waiting += 1
            self._was_blocked = True
            self._room.clear()
            try:
                await self._room.wait()
            finally:
                self._waiting -= 1
        loop = asyncio.get_running_loop()
        if not self.pending:
            self._first_at = loop.time()
        self.pending.extend(entries)
        if len(self.pending) >= self.max_batch:
            self._full.set()
        self._idle.clear()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._flush_forever())

    def paused(self) -> bool:
        """True when an agent waits for room now, or did since the last call."""
        was, self._was_blocked = self._was_blocked, False
        return was or self._waiting > 0

    async def settled(self) -> None:
        """Returns once everything added so far is processed and acknowledged."""
        await self._idle.wait()

    async def _flush_forever(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self.pending:
                    await self._gather(loop)
                    batch, self.pending = self.pending[:self.max_batch], self.pending[self.max_batch:]
                    self._first_at = loop.time() if self.pending else None
                    self._room.set()
                    await self._process(batch)
                self._idle.set()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the core never raises for bad input: this is the broker or a bug
            self._crashed = exc
            log.exception("streams: batch processing stopped")
            if self.on_crash is None:
                raise
            self.on_crash(exc)

    async def _gather(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait for more messages: linger_s after the first, longer while a backlog waits."""
        first = self._first_at or loop.time()
        wait = self.linger_s - (loop.time() - first)
        if wait > 0:
            await self._until_full(wait)
        deadline = first + self.max_linger_s
        while (self.backlog is not None and len(self.pending) < self.max_batch and loop.time() < deadline
               and self.backlog()):
            await asyncio.sleep(min(0.002, deadline - loop.time()))  # the agents read meanwhile

    async def _until_full(self, timeout: float) -> None:
        if len(self.pending) >= self.max_batch:
            return
        self._full.clear()
        try:
            await asyncio.wait_for(self._full.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _process(self, batch: list[tuple[Input | Tick, Any]]) -> None:
        self.stats["batches"] += 1
        self.stats["messages"] += len(batch)
        self.stats["largest"] = max(self.stats["largest"], len(batch))
        guard = self.guard
        run: list[Input] = []
        for item, _ in batch:
            if isinstance(item, Input):
                if guard is not None and guard.suspects:
                    verdict = guard.verdict(item.topic, item.partition, item.offset)
                    if verdict != OK:  # in flight in a crash: alone, or (poison) not at all
                        await self._inputs(run)
                        run = []
                        if verdict == POISON:
                            await self.core.on_poison(item, guard.crashes(item.topic, item.partition, item.offset))
                        else:
                            await self._inputs([item])
                        continue
                run.append(item)
                continue
            await self._inputs(run)
            run = []
            await self.core.on_tick(item.partition)
        await self._inputs(run)
        await self.ack([token for _, token in batch])
        if guard is not None and guard.suspects:
            guard.end(spans((m.topic, m.partition, m.offset) for m, _ in batch if isinstance(m, Input)))

    async def _inputs(self, run: list[Input]) -> None:
        """Input messages through the core, their positions recorded while they are processed."""
        if not run:
            return
        guard = self.guard
        if guard is None:
            await self.core.on_batch(run)
            return
        guard.begin(spans((m.topic, m.partition, m.offset) for m in run))
        if self.crash_marker is not None:
            for m in run:
                if m.value is not None and self.crash_marker in m.value:
                    crash_now("stream worker", (m.topic, m.partition, m.offset))
        try:
            await self.core.on_batch(run)
        except asyncio.CancelledError:  # stopped, not crashed
            guard.end()
            raise
        except DeliveryFailed:  # the broker's fault, not the batch's: no crash counts against its messages
            guard.abandon()
            raise
        guard.end()
