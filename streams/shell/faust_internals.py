"""Every use of Faust's and aiokafka's private names, in one place (faust-streaming is pinned
to the version these were written and tested against, in pyproject.toml).

- `BatchConsumer`: Faust's Kafka consumer, handing the worker's input topics over a fetch at a time
  (`ack_all`: a processed batch's messages acknowledged in one call);
- `transport_producer(app)`: the started aiokafka producer under Faust's;
- `partition_for(producer, topic, key)`: the partition aiokafka's `send()` would pick;
- `BoundedStopWorker`: Faust's worker, whose stop on a signal ends the process within a bound.

tests/test_streams_faust_internals.py checks that no other module of the worker reaches into
a private name of another object.

Faust delivers each message on its own: for every message its fetch loop starts a task
pair (the conductor's callback raced against flow control), the conductor decodes it into
an Event and queues it, and the agent's stream iterator yields to the event loop once per
message. Under load that path cost the worker more CPU than its own batch work
(`python -m benchmarks.bench_streams --profile FILE` shows where the worker's CPU goes).

`BatchConsumer` is Faust's aiokafka consumer with one change: messages of the topics the
app names in `batch_inputs` leave each fetch as one list for the worker's InputFeed; every
other topic (the ticks, the table's changelog) still goes through Faust's conductor, in
its place in the fetch. The fetch itself is Faust's `getmany` taken whole (its order,
checks and seek), with the partition's high-water mark read once per fetch rather than
once per message. Everything else stays Faust's: group membership and partition
assignment (so the `runs` table stays co-partitioned with the inputs), seeks, flow control
during a rebalance, and the offset commits, which follow the acknowledgements (`ack_all`
books a batch's as `Consumer.ack` books each message's). A message handed over is tracked as unacknowledged, so a rebalance or shutdown
waits for it to be processed (Faust's `wait_empty`), and its partition's inbound time is
recorded as a stream's sensor would (Faust's check for a stream that stopped processing).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP, Message
from faust.types.tuples import ack_lock
from mode.utils.futures import notify

# (the topic names to batch, the coroutine that takes a fetch's messages of them, in order)
BatchInputs = tuple[Collection[str], Callable[[list[Message]], Awaitable[None]]]


class BatchConsumer(faust_aiokafka.Consumer):
    async def _drain_messages(self, fetcher: Any) -> None:
        inputs: BatchInputs | None = getattr(self.app, "batch_inputs", None)
        if inputs is None:
            await super()._drain_messages(fetcher)
            return
        topics, deliver = inputs
        read_offset = self._read_offset
        acks_enabled_for = self.app.topics.acks_enabled_for
        try:
            while not (self._stopped.is_set() or fetcher._stopped.is_set()):
                generation = self.app.consumer_generation_id
                batch: list[Message] = []
                for tp, message in await self._fetch(timeout=1.0):
                    # what Faust's getmany checks before it yields each message
                    if not self.flow_active or self.app.consumer_generation_id != generation:
                        break
                    last = read_offset[tp]
                    if last is not None and message.offset < last:
                        continue  # behind where a seek put the partition: Faust drops these too
                    if last is not None and message.offset - last > 1 and acks_enabled_for(tp.topic):
                        await self._add_gap(tp, last + 1, message.offset)  # so commits can pass the gap
                    read_offset[tp] = message.offset
                    if tp.topic in topics:
                        batch.append(message)
                        continue
                    await self._hand_over(batch, deliver, generation)  # what came before it, first
                    batch = []
                    await self.wait_first(self.callback(message), self.suspend_flow.wait())
                await self._hand_over(batch, deliver, generation)
                await asyncio.sleep(0)  # a fetch that returned at once must not starve the loop
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                return
            raise

    async def _fetch(self, timeout: float) -> list[tuple[TP, Message]]:
        """One fetch as Faust's `getmany` yields it (its partitions in turn, the partitions it
        reads now), but whole: getmany asks for the partition's high-water mark for Faust's lag
        monitor once per message; here once per partition and fetch."""
        records, active = await self._wait_next_records(timeout)
        if records is None or self.should_stop:
            return []
        if not self.flow_active:
            try:  # as getmany: a fetch while the flow is stopped seeks back to the committed offsets
                await self.perform_seek()
            except Exception as exc:  # noqa: BLE001 - getmany logs and goes on
                self.log.warning("exception performing seek when flow not active %r", exc)
            return []
        buffered = self._buffered_partitions
        reads = [tp for tp in records if active is None or tp in active or tp in buffered]
        monitor = self.app.monitor
        for tp in reads:
            monitor.track_tp_end_offset(tp, self.highwater(tp))
        to_message = self._to_message
        return [(tp, to_message(tp, record)) for tp, record in self.scheduler.iterate(records)
                if active is None or tp in active or tp in buffered]

    async def _hand_over(self, batch: list[Message], deliver: Callable[[list[Message]], Awaitable[None]],
                         generation: int) -> None:
        if not batch:
            return
        if not self.flow_active or generation != self.app.consumer_generation_id:
            return  # a rebalance began: these are read again from the committed offsets
        for message in batch:
            self.track_message(message)
        monitor = self.app.monitor
        if monitor is not None:  # what a stream's sensor records: Faust's "stream idle" check reads it
            now = time.monotonic()
            for tp in {message.tp for message in batch}:
                monitor.stream_inbound_time[tp] = now
        await deliver(batch)

    def ack_all(self, messages: list[Message]) -> None:
        """`Consumer.ack` for each message, in order (their offsets may be committed now):
        Faust's bookkeeping under its ack lock taken once, the waiter for acks woken once."""
        acks_enabled_for = self.app.topics.acks_enabled_for
        committed, acked_index, acked = self._committed_offset, self._acked_index, self._acked
        unacked = self._unacked_messages
        woken = False
        with ack_lock:
            for message in messages:
                if message.acked:
                    continue
                message.acked = True
                if not acks_enabled_for(message.topic):
                    continue
                woken = True
                tp, offset = message.tp, message.offset
                last = committed[tp]
                if last is None or offset >= last:
                    index = acked_index[tp]
                    if offset not in index:
                        unacked.discard(message)
                        index.add(offset)
                        acked[tp].append(offset)
                        self._n_acked += 1
            if woken:
                notify(self._waiting_for_ack)


class BatchTransport(faust_aiokafka.Transport):
    Consumer = BatchConsumer


class BatchApp(faust.App):
    """A Faust app whose consumer batches the topics set in `batch_inputs` (None: it does not)."""

    batch_inputs: BatchInputs | None = None

    def _new_transport(self) -> Any:
        return BatchTransport(self.conf.broker_consumer, self)


def transport_producer(app: faust.App) -> Any:
    """The started aiokafka producer under Faust's producer (Faust starts it on first use)."""
    return app.producer._ensure_producer()


def partition_for(producer: Any, topic: str, key: bytes | None) -> int:
    """The partition aiokafka's `send()` picks: its partitioner over the key (murmur2, as every
    Kafka client's default); with no key, the partitioner's own choice."""
    return producer._partition(topic, None, key, None, key, None)


class BoundedStopWorker(faust.Worker):
    """Faust's worker whose stop on SIGTERM or SIGINT ends the process within `stop_timeout_s`.

    Faust's clean stop flushes the producer and commits offsets; with the broker unreachable it
    waited there for good (a worker was still in `stop_and_shutdown` 70 s after a SIGTERM, and one
    left behind once spun on a core for half an hour). Past the bound the process calls
    `before_exit` (the crash guard's `abandon`: a stop is not a crash, so the batch it leaves in
    flight does not count towards a poison message's crashes) and exits with status 1 without the
    rest of the stop: what it had not committed, Kafka redelivers to the next worker, whose outputs
    are idempotent (CONTRACT.md). mode's `_schedule_shutdown` is the one hook every stop signal
    passes through."""

    def __init__(self, *args: Any, stop_timeout_s: float, before_exit: Callable[[], None] = lambda: None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stop_timeout_s = stop_timeout_s
        self.before_exit = before_exit

    _bounded = False

    def _schedule_shutdown(self, signal: Any) -> None:
        # the first stop signal arms the bound (a second changes nothing); a stop is not a crash
        self._bound(f"{getattr(signal, 'name', signal)} (Kafka unreachable?)", self.before_exit)
        super()._schedule_shutdown(signal)

    def on_worker_shutdown(self) -> None:
        # Every way out passes here before Faust's stop, a crash of the app's services too (the batcher's
        # `on_crash`). A crash is a crash: its batch in flight keeps counting, so no `before_exit`.
        self._bound("it began to stop without a signal (a crash?)", lambda: None)
        super().on_worker_shutdown()

    def _bound(self, after: str, before_exit: Callable[[], None]) -> None:
        """Arm the bound once, whichever way the stop began."""
        if not self._bounded:
            self._bounded = True
            exit_unless_stopped(self.stop_timeout_s, f"stream worker: not stopped {self.stop_timeout_s:g} s after "
                                f"{after}; exiting without a clean stop, Kafka redelivers what was not committed",
                                before_exit)


def exit_unless_stopped(seconds: float, why: str, before_exit: Callable[[], None] = lambda: None) -> threading.Timer:
    """A daemon timer that ends the process (status 1, `why` on stderr, `before_exit` first) unless it
    exited first."""
    def expire() -> None:
        try:
            sys.stderr.write(why + "\n")
            sys.stderr.flush()
            before_exit()
        finally:
            os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer
