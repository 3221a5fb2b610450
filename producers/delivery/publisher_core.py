"""The Publisher's rules without threads or I/O (pure; the shell is `publisher.py`).

A message is in one of three places: queued (in memory, as the caller gave it), in flight
(handed to the Kafka client, not yet acknowledged) or in the journal (on disk, re-sent once
the broker answers). `PublisherCore` keeps the queue and what is in flight and decides:

- when the broker counts as away (`blocked`): no connection, a re-send under way, a journal
  to re-send first, or the oldest message in flight unacknowledged for `stall_s`; then new
  messages go to the end of the journal, so the order per run holds;
- what goes to the journal: the queue when it is full or the broker is away, a message the
  client refused or gave up on (it is journaled before it leaves the queue or the pipeline,
  so a flush never finds it nowhere), what is unacknowledged at shutdown (`close`,
  put before the journal's pending records);
- what to re-send (`resend_size`: one record as a probe after a failure, else a chunk) and
  how far the journal's cursor moves once the broker answered (`settle_resend`: up to the last
  record acknowledged in order);
- when to try the broker again (`RETRY`, measured on the injected clock).

`step` is one round of the sender's work in that order. The I/O is the shell's, behind a
`Port` given to the constructor: the journal file (append, read, advance), the Kafka client
(connect, send: a `Delivery`, or None when the client refused the message at once) and the
encoding of an item. The core makes no thread; the shell's lock that keeps the journal in
publish order is handed in (`order`). Tests drive it with an in-memory port and a fake clock
(tests/test_publisher_core.py): no broker, no sleep.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from contextlib import AbstractContextManager
from typing import Generic, Protocol, TypeVar

from areal_metrics.producers.delivery.backends import Delivery
from areal_metrics.producers.delivery.journal import JournalRecord
from areal_metrics.producers.runtime.backoff import Backoff

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)
Message = tuple[str, bytes, bytes]  # topic, key, value

RETRY = Backoff(initial_s=0.5, max_s=5.0)  # reconnecting to a broker that is away
RESEND_CHUNK = 2000  # journal records re-sent per acknowledged chunk
# queued items a full queue moves to the journal on the caller's thread per call: the whole queue
# (100,000 encodes and writes) held one log() call 1.4-2 s; a chunk bounds the call (~10-20 ms)
SPILL_CHUNK = 1000


class Port(Protocol[T_contra]):
    """The shell's I/O as the core sees it."""

    def encode(self, item: T_contra) -> Message:
        """(topic, key, value) of a queued item; must not raise."""

    def append(self, message: Message) -> bool:
        """Append one message to the end of the journal; False when it could not be written (a full disk)."""

    def prepend(self, messages: list[Message]) -> bool:
        """Put messages before the journal's pending records (closing with messages in flight); False when
        they could not be written."""

    def journal_pending(self) -> bool: ...

    def read(self, max_records: int) -> Sequence[JournalRecord]:
        """The journal's oldest pending records, in order."""

    def advance(self, end: int) -> None:
        """Everything in the journal before offset `end` is acknowledged."""

    def connected(self) -> bool: ...

    def connect(self) -> bool:
        """Try to open the Kafka client once; False when the broker cannot be reached."""

    def send(self, message: Message, *, resend: bool) -> Delivery | None:
        """Hand one message to the client: its delivery, or None when it refused it at once."""


@dataclass(slots=True)
class InFlight:
    delivery: Delivery
    message: Message
    sent_at: float


@dataclass(slots=True)
class Resend:
    records: Sequence[JournalRecord]
    deliveries: list[Delivery]


class PublisherCore(Generic[T]):
    def __init__(
        self,
        port: Port[T],
        *,
        max_queue: int = 100_000,
        max_in_flight: int = 20_000,
        spill_chunk: int = SPILL_CHUNK,
        stall_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        retry: Backoff = RETRY,
        resend_chunk: int = RESEND_CHUNK,
        order: AbstractContextManager[object] | None = None,
    ) -> None:
        self.port = port
        self._order = order if order is not None else contextlib.nullcontext()  # held while the journal grows
        self.max_queue = max_queue
        self.max_in_flight = max_in_flight
        self.spill_chunk = max(1, spill_chunk)
        self.stall_s = stall_s  # oldest message unacknowledged this long: the broker is away
        self.clock = clock
        self.retry = retry
        self.resend_chunk = resend_chunk
        self.queue: collections.deque[T] = collections.deque()
        self.in_flight: collections.deque[InFlight] = collections.deque()
        self.resending: Resend | None = None
        self.failures = 0  # in a row: the wait before the next try grows (`retry`)
        self.backoff_until = 0.0
        self._counter = itertools.count()  # next() is atomic under the GIL: callers on several threads
        self.queued = 0  # enqueue() calls accepted
        self.sent = 0  # acknowledged on the first try
        self.spilled = 0  # written to the journal
        self.resent = 0  # acknowledged after coming back from the journal
        self.failed = 0  # send attempts that failed (each then went to the journal)
        self.lost = 0  # bound for the journal and not written (a full disk): never delivered

    # ------------------------------------------------------------ the caller's side

    def enqueue(self, item: T) -> bool:
        """Count the item and queue it; False when the queue is full (the caller then calls `make_room(item)`)."""
        self.queued = next(self._counter) + 1
        if len(self.queue) < self.max_queue:
            self.queue.append(item)
            return True
        return False

    def make_room(self, item: T) -> None:
        """The queue is full (the sender is stuck): its `spill_chunk` oldest items go to the journal,
        then `item` joins the queue. Order holds: what the journal holds is older than the queue, and
        the sender sends the journal first."""
        for _ in range(min(self.spill_chunk, len(self.queue))):
            self._to_journal(self.port.encode(self.queue[0]))  # journaled, then popped
            self.queue.popleft()
        if len(self.queue) < self.max_queue:
            self.queue.append(item)
        else:  # a queue of max_queue 0
            self._to_journal(self.port.encode(item))

    def journal_queue(self, *also: T) -> bool:
        """The queue, then `also`, to the journal, oldest first; True when something moved."""
        moved = False
        while self.queue:
            self._to_journal(self.port.encode(self.queue[0]))  # journaled, then popped
            self.queue.popleft()
            moved = True
        for item in also:
            self._to_journal(self.port.encode(item))
            moved = True
        return moved

    def idle(self, *, connected: bool, journal_pending: bool, journaled_ok: bool = False) -> bool:
        """Everything so far acknowledged; with `journaled_ok`, also when not connected and the rest is journaled."""
        return (not self.queue and not self.in_flight and self.resending is None
                and (not journal_pending or (journaled_ok and not connected)))

    @property
    def pending(self) -> int:
        """Messages in memory (queued or in flight), not yet acknowledged."""
        return len(self.queue) + len(self.in_flight)

    # ------------------------------------------------------------ the sender's side

    def step(self) -> bool:
        """One round of the sender's work; True when something was done.

        Order of delivery is: in flight (inside the Kafka client, which retries in
        order), then the journal, then the queue. While the broker is away (no
        connection, a stalled pipeline, a journal to re-send), new items go to the
        end of the journal instead of into the client.
        """
        port = self.port
        worked = self.reap() | self.settle_resend()
        if self.wants_connection(connected=port.connected(), journal_pending=port.journal_pending()):
            if not port.connect():
                self.back_off()
        connected = port.connected()
        if self.blocked(connected=connected, journal_pending=port.journal_pending()):
            with self._order:
                worked |= self.journal_queue()
            size = self.resend_size(connected=connected, journal_pending=port.journal_pending())
            if size:
                worked |= self.start_resend(port.read(size))
            return worked
        while self.may_send():
            with self._order:
                if not self.send_head():
                    break
            worked = True
            if port.journal_pending():
                break
        return worked

    def close(self) -> None:
        """At shutdown, after the client's last poll: everything not acknowledged goes to the journal, oldest first."""
        self.reap()
        # A re-sent chunk still partly unanswered: the records acknowledged in order leave the
        # journal now, or the next process re-sends them (a duplicate); the rest stay there.
        self.settle_resend(closing=True)
        older = []
        for item in self.in_flight:
            if item.delivery.succeeded():  # False while not done
                self.sent += 1
            else:
                older.append(item.message)
        self.in_flight.clear()
        self._to_journal_front(older)
        with self._order:  # an item enqueued after the last step
            self.journal_queue()

    def abandon(self) -> None:
        """The sender is stuck inside the Kafka client and is left behind (the caller holds the order
        lock, so no item is between the queue and the pipeline): what the broker has not acknowledged,
        in flight and then queued, goes to the journal, oldest first. An item the client still delivers
        later is sent twice, with its event_id (readers count it once); none is lost."""
        older = [item.message for item in list(self.in_flight) if not item.delivery.succeeded()]
        self.in_flight.clear()
        self._to_journal_front(older)
        self.journal_queue()

    def backing_off(self) -> bool:
        return self.clock() < self.backoff_until

    def back_off(self) -> None:
        """A try failed: the next waits longer (`retry`)."""
        self.failures += 1
        self.backoff_until = self.clock() + self.retry.delay(self.failures)

    def wants_connection(self, *, connected: bool, journal_pending: bool) -> bool:
        return not connected and (bool(self.queue) or journal_pending) and not self.backing_off()

    def blocked(self, *, connected: bool, journal_pending: bool) -> bool:
        """The broker is away (or the journal goes first): new messages go to the journal."""
        if not connected or self.resending is not None or journal_pending:
            return True
        # A full pipeline alone is back-pressure, not an outage: the queue holds the rest.
        return bool(self.in_flight) and self.clock() - self.in_flight[0].sent_at > self.stall_s

    def may_send(self) -> bool:
        return bool(self.queue) and len(self.in_flight) < self.max_in_flight

    def send_head(self) -> bool:
        """Hand the oldest queued item to the client: in flight, or journaled when it is refused; False when none."""
        if not self.queue:
            return False
        message = self.port.encode(self.queue[0])
        delivery = self.port.send(message, resend=False)
        if delivery is None:
            self.failed += 1
            self._to_journal(message)
        else:
            self.in_flight.append(InFlight(delivery, message, self.clock()))
        self.queue.popleft()  # popped only once it is in flight or journaled
        return True

    def reap(self) -> bool:
        """Count the acknowledged messages at the head of the pipeline, in order; journal the failed ones."""
        worked = False
        while self.in_flight and self.in_flight[0].delivery.is_done:
            item = self.in_flight[0]
            worked = True
            if item.delivery.succeeded():
                self.sent += 1
            else:
                self.failed += 1
                self._to_journal(item.message)  # journaled before it leaves the pipeline
            self.in_flight.popleft()
        return worked

    def resend_size(self, *, connected: bool, journal_pending: bool) -> int:
        """How many journal records to re-send now: 0 (not now), 1 (a probe after a failure) or a chunk."""
        if not connected or self.in_flight or self.resending is not None or not journal_pending:
            return 0
        if self.backing_off():
            return 0
        return 1 if self.failures > 0 else self.resend_chunk

    def start_resend(self, records: Sequence[JournalRecord]) -> bool:
        """Hand journal records to the client; a refusal stops the chunk there and backs off."""
        if not records:
            return False
        deliveries: list[Delivery] = []
        for r in records:
            delivery = self.port.send((r.topic, r.key, r.value), resend=True)
            if delivery is None:
                self.failed += 1
                self.back_off()
                break
            deliveries.append(delivery)
        self.resending = Resend(records, deliveries)
        return True

    def settle_resend(self, *, closing: bool = False) -> bool:
        """Once every re-send is done (or at `closing`, whatever is done): the journal advances
        past the records acknowledged in order.

        The rest stays in the journal and the next try waits (`retry`); True when settled.
        """
        if self.resending is None:
            return False
        records, deliveries = self.resending.records, self.resending.deliveries
        if not closing and not all(d.is_done for d in deliveries):
            return False
        acked = 0
        for d in deliveries:
            if not d.succeeded():  # False while not done
                break
            acked += 1
        if acked:
            self.port.advance(records[acked - 1].end)  # a record leaves the journal only once acknowledged
            self.resent += acked
        if acked < len(records):
            if acked < len(deliveries) and deliveries[acked].is_done:  # it failed (a refusal was counted already)
                self.failed += 1
            self.back_off()
        else:
            self.failures = 0
        self.resending = None
        return True

    def _to_journal(self, message: Message) -> None:
        if self.port.append(message):
            self.spilled += 1
        else:
            self.lost += 1

    def _to_journal_front(self, messages: list[Message]) -> None:
        """`messages`, older than what the journal holds, before it (what was in flight at the end)."""
        if not messages:
            return
        if self.port.prepend(messages):
            self.spilled += len(messages)
        else:
            self.lost += len(messages)
