"""The non-blocking publisher the trainers use.

`publish(event)` appends the record to an in-memory queue and returns: no
serialisation, no I/O, no lock on the caller's thread. A background sender
thread serialises and hands the messages to a Kafka client (acks=all,
idempotent, key = run_id): confluent-kafka when installed, else kafka-python
(`areal_metrics.producers.delivery.backends`). When the broker cannot be reached, or the queue is
full, messages go to an append-only journal on disk (`areal_metrics.producers.delivery.journal`);
once the broker answers again the journal is re-sent in order, before any
newer message. A message leaves the journal only after the broker
acknowledged it, so nothing is lost; a re-send carries the same event_id, so
nothing is counted twice downstream.

Order per run holds for outages shorter than `delivery_timeout_s` (10 minutes
by default): messages already inside the Kafka client are retried by it, in
order, and newer ones wait in the journal behind them. A message that
the client gives up on after that timeout is journaled behind newer ones:
still delivered, with its event_id, but out of order (the stream worker
orders steps by step number anyway).

At interpreter exit a publisher that was not closed closes itself (atexit,
waiting at most `exit_timeout_s`): what the broker has not acknowledged by
then is in the journal. The queue also takes `Outgoing` items, records built
on the sender thread (the client's steps: the caller only enqueues a dict).
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import os
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from areal_metrics.producers.delivery import backends as delivery
from areal_metrics.producers.runtime.backoff import Backoff
from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.events import Event
from areal_metrics.producers.delivery.journal import Journal, open_journal
from areal_metrics.producers.contract.settings import Settings, state_dir, read_setting
from areal_metrics.producers.contract.topics import Topics

log = logging.getLogger(__name__)

RETRY = Backoff(initial_s=0.5, max_s=5.0)  # reconnecting to a broker that is away
_IDLE_WAIT_S = 0.02  # how long the sender sleeps when idle: rare wake-ups leave the GIL to training
_RESEND_CHUNK = 2000  # journal records re-sent per acknowledged chunk


class Outgoing(Protocol):
    """A record the sender thread builds: `encode` gives (topic, key, value); it must not raise."""

    def encode(self, topics: Topics) -> tuple[str, bytes, bytes]: ...


@dataclass(frozen=True, slots=True)
class PublisherStats:
    queued: int  # publish() calls accepted
    sent: int  # acknowledged by the broker on the first try
    spilled: int  # written to the journal
    resent: int  # acknowledged after coming back from the journal
    failed: int  # send attempts that failed (each then went to the journal)
    pending: int  # in memory or journal, not yet acknowledged


@dataclass(slots=True)
class _InFlight:
    future: Any
    topic: str
    key: bytes
    value: bytes
    sent_at: float


class Publisher:
    def __init__(
        self,
        bootstrap: str,
        topics: Topics | None = None,
        journal_dir: Path | str | None = None,
        *,
        max_queue: int = 100_000,
        max_in_flight: int = 20_000,
        delivery_timeout_s: float = 600.0,
        stall_s: float = 5.0,
        kafka_config: dict[str, Any] | None = None,
        fsync_journal: bool = False,
        close_at_exit: bool = True,
        exit_timeout_s: float = 10.0,
        kafka_client: str = "auto",
        bootstrap_origin: str | None = None,
    ) -> None:
        self.topics = topics or Topics(read_setting("topic_prefix"))
        self.max_queue = max_queue
        self._max_in_flight = max_in_flight
        self._delivery_timeout_s = delivery_timeout_s
        self._stall_s = stall_s  # oldest message unacknowledged this long: the broker is away
        self._kafka_config = {"bootstrap_servers": bootstrap.split(","), **(kafka_config or {})}
        codec = self._kafka_config.get("compression_type")
        problem = delivery.compression_problem(codec, kafka_client)
        if problem is not None:  # before anything is opened: a misconfiguration stops here, in one line
            raise ConfigError(f"AREAL_KAFKA_COMPRESSION={codec}: {problem}")
        self._journal = open_journal(Path(journal_dir or state_dir() / "journal" / "default"), fsync=fsync_journal)
        self._queue: collections.deque[Event | Outgoing] = collections.deque()
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._queued = itertools.count()  # next() is atomic under the GIL
        self._n_queued = 0
        self._sent = self._spilled = self._resent = self._failed = 0
        if kafka_client not in delivery.CLIENTS:
            raise ValueError(f"kafka_client {kafka_client!r}: expected one of {', '.join(delivery.CLIENTS)}")
        self._client = kafka_client
        # Set: the first event that goes to the journal says so once on stderr (the client's users see it).
        self._origin = bootstrap_origin
        self._told = False
        self._producer: delivery.Producer | None = None
        self._backoff_until = 0.0
        self._failures = 0  # in a row: the wait before the next try grows (RETRY)
        self._resending: tuple[list[Any], list[Any]] | None = None
        self._order_lock = threading.Lock()  # the journal is appended in publish order
        self._wake = threading.Event()
        self._closing = False
        self._close_lock = threading.Lock()
        self._close_started = False
        self._abandoned = False  # close() gave up waiting for the sender thread
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="areal-publisher", daemon=True)
        self._thread.start()
        self.exit_timeout_s = exit_timeout_s
        if close_at_exit:
            _close_at_exit(self)

    @classmethod
    def from_settings(cls, settings: Settings | None = None, journal_dir: Path | str | None = None, **kw: Any) -> Publisher:
        settings = settings or Settings.from_env()
        config = settings.kafka_python_config()
        bootstrap = ",".join(config.pop("bootstrap_servers"))  # type: ignore[arg-type]
        kw.setdefault("kafka_client", settings.kafka_client)
        if settings.kafka_compression != "none":  # a producer's setting: kafka_python_config serves consumers too
            config["compression_type"] = settings.kafka_compression
        return cls(bootstrap, settings.topics, journal_dir, kafka_config=config, **kw)

    # ------------------------------------------------------------ caller side

    def publish(self, event: Event | Outgoing) -> None:
        """Enqueue and return at once. Never raises a transport error."""
        if self._closing:
            raise RuntimeError("publish() after close()")
        self._n_queued = next(self._queued) + 1
        if len(self._queue) < self.max_queue:
            self._queue.append(event)
            return
        # Memory is full (the sender is stuck): move the queue and this event to
        # the journal, oldest first, so the order per run holds.
        with self._order_lock:
            self._queue_to_journal()
            self._spill(*self._encode(event))

    def flush(self, timeout: float = 30.0, *, journaled_ok: bool = False) -> bool:
        """Wait until everything published so far is acknowledged; False on timeout.

        `journaled_ok`: also done once the broker is away (no connection) and
        everything is in the journal (what exit wants: delivered or on disk).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._queue and not self._in_flight and self._resending is None and (
                    not self._journal.has_pending() or (journaled_ok and self._producer is None)):
                return True
            if self._stopped.is_set():
                return False
            self._wake.set()
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 10.0, *, journaled_ok: bool = False) -> None:
        """Flush for up to `timeout`; whatever is still unsent stays in the journal for the next start."""
        with self._close_lock:  # one closer: a second (atexit beside the caller's) returns at once
            if self._close_started:
                return
            self._close_started = True
        self.flush(timeout, journaled_ok=journaled_ok)
        self._closing = True
        _OPEN.discard(self)
        self._wake.set()
        self._thread.join(timeout=max(timeout, 5.0))
        if self._thread.is_alive():
            # The sender is stuck inside the Kafka client (e.g. a handshake that keeps
            # failing): journal what is queued from here, and let the thread go.
            with self._order_lock:
                self._abandoned = True
                self._queue_to_journal()
        else:
            with self._order_lock:  # a publish() that passed its check as close began, after the sender's last drain
                self._queue_to_journal()
        self._journal.close()

    def stats(self) -> PublisherStats:
        pending = len(self._queue) + len(self._in_flight)
        return PublisherStats(
            queued=self._n_queued,
            sent=self._sent,
            spilled=self._spilled,
            resent=self._resent,
            failed=self._failed,
            pending=pending + (1 if self._journal.has_pending() else 0),
        )

    @property
    def kafka_client(self) -> str | None:
        """The client delivering ("confluent-kafka" or "kafka-python"); None before the first connection."""
        producer = self._producer
        return producer.name if producer is not None else None

    @property
    def journal(self) -> Journal:
        return self._journal

    # ------------------------------------------------------------ sender side

    def _spill(self, topic: str, key: bytes, value: bytes) -> None:
        self._journal.append(topic, key, value)
        self._spilled += 1
        if not self._told:
            self._tell_undelivered()

    def _tell_undelivered(self) -> None:
        """Once per publisher: events are not reaching the broker; where they wait, how to send them."""
        self._told = True
        bootstrap = ",".join(self._kafka_config["bootstrap_servers"])
        origin = f" ({self._origin})" if self._origin else ""
        message = (f"areal-metrics: cannot deliver to the Kafka broker at {bootstrap}{origin}; events are kept in "
                   f"the journal {self._journal.directory} and re-sent when it answers (or: areal-metrics sync)")
        if self._origin is not None:
            print(message, file=sys.stderr, flush=True)
            if log.hasHandlers():  # the user's logging gets it too; without handlers stderr has it already
                log.warning(message)
        else:  # a publisher of the CLI or a service: its caller reports delivery itself
            log.info(message)

    def _run(self) -> None:
        try:
            while not self._closing:
                if not self._step():
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
            self._shutdown()
        except Exception:  # the sender must never die silently: log, keep what is left
            log.exception("publisher sender thread failed; unsent events stay in the journal")
            self._shutdown()
        finally:
            self._stopped.set()

    def _step(self) -> bool:
        """One round of work; True when something was done.

        Order of delivery is: in flight (inside the Kafka client, which retries in
        order), then the journal, then the queue. While the broker is away
        (no producer, a stalled or full pipeline, a journal to re-send), new
        events go to the end of the journal instead of into the client.
        """
        if self._producer is not None:
            self._producer.poll()
        worked = self._reap_in_flight() | self._reap_resend()
        has_work = bool(self._queue) or self._journal.has_pending()
        if has_work and self._producer is None and time.monotonic() >= self._backoff_until:
            self._ensure_producer()
        if self._blocked():
            with self._order_lock:
                worked |= self._queue_to_journal()
            if (self._producer is not None and not self._in_flight and self._resending is None
                    and self._journal.has_pending() and time.monotonic() >= self._backoff_until):
                worked |= self._start_resend()
            return worked
        while self._queue and len(self._in_flight) < self._max_in_flight:
            with self._order_lock:
                if not self._queue:
                    break
                # popped only once it is in flight or journaled: flush() never sees it nowhere
                self._send(*self._encode(self._queue[0]))
                self._queue.popleft()
            worked = True
            if self._journal.has_pending():
                break
        return worked

    def _blocked(self) -> bool:
        """The broker is away (or the journal goes first): new events go to the journal."""
        if self._producer is None or self._resending is not None or self._journal.has_pending():
            return True
        # A full pipeline alone is back-pressure, not an outage: the queue holds the rest.
        return bool(self._in_flight) and time.monotonic() - self._in_flight[0].sent_at > self._stall_s

    def _queue_to_journal(self) -> bool:
        """Caller holds _order_lock."""
        moved = False
        while self._queue:
            self._spill(*self._encode(self._queue[0]))  # journaled, then popped (see _step)
            self._queue.popleft()
            moved = True
        return moved

    def _encode(self, item: Event | Outgoing) -> tuple[str, bytes, bytes]:
        if isinstance(item, Event):
            return self.topics.for_event(item), item.run_id.encode(), item.to_json()
        return item.encode(self.topics)

    def _ensure_producer(self) -> bool:
        if self._producer is not None:
            return True
        if not self._bootstrap_reachable():
            self._back_off()
            return False
        try:
            self._producer = delivery.create(self._kafka_config, self._client,
                                             delivery_timeout_s=self._delivery_timeout_s)
        except delivery.SendError as exc:
            log.warning("publisher: broker not available (%s); journaling", exc)
            self._back_off()
            return False
        except Exception:  # a bad setting: say so, keep journaling, never kill the sender
            log.exception("publisher: cannot create the Kafka producer; journaling")
            self._back_off()
            return False
        return True

    def _bootstrap_reachable(self) -> bool:
        return bootstrap_reachable(self._kafka_config["bootstrap_servers"])

    def _back_off(self) -> None:
        self._failures += 1
        self._backoff_until = time.monotonic() + RETRY.delay(self._failures)

    def _send(self, topic: str, key: bytes, value: bytes) -> None:
        try:
            future = self._producer.send(topic, key, value)
        except delivery.SendError as exc:  # metadata or buffer timeout: the broker is away
            log.warning("publisher: send failed (%s); journaling", exc)
            self._failed += 1
            self._spill(topic, key, value)
            return
        self._in_flight.append(_InFlight(future, topic, key, value, time.monotonic()))

    def _reap_in_flight(self) -> bool:
        """Count acknowledged messages; failed ones (delivery timeout) go to the journal."""
        worked = False
        while self._in_flight and self._in_flight[0].future.is_done:
            item = self._in_flight[0]
            worked = True
            if item.future.succeeded():
                self._sent += 1
            else:
                self._failed += 1
                self._spill(item.topic, item.key, item.value)  # journaled before it leaves in_flight
            self._in_flight.popleft()
        return worked

    def _start_resend(self) -> bool:
        """Hand the oldest journal chunk to the Kafka client; `_reap_resend` moves the cursor."""
        probing = self._failures > 0  # after a failure, one record before a whole chunk
        records = self._journal.read(1 if probing else _RESEND_CHUNK)
        if not records:
            return False
        futures = []
        try:
            for r in records:
                futures.append(self._producer.send(r.topic, r.key, r.value))
        except delivery.SendError as exc:
            log.warning("publisher: re-send from journal failed (%s); retrying later", exc)
            self._failed += 1
            self._back_off()
        self._resending = (records, futures)
        return True

    def _reap_resend(self) -> bool:
        if self._resending is None:
            return False
        records, futures = self._resending
        if not all(f.is_done for f in futures):
            return False
        acked = 0
        for f in futures:
            if not f.succeeded():
                break
            acked += 1
        if acked:
            self._journal.advance(records[acked - 1].end)
            self._resent += acked
        if acked < len(records):
            if acked < len(futures):  # a delivery failed (a failed send() was counted already)
                self._failed += 1
            self._back_off()
        else:
            self._failures = 0
        self._resending = None
        return True

    def _shutdown(self) -> None:
        """Keep everything not acknowledged on disk, oldest first, for the next start."""
        if self._abandoned:  # close() has journaled the queue and closed the journal
            if self._producer is not None:
                self._producer.close(timeout=0)
            return
        if self._producer is not None:
            try:
                self._producer.flush(timeout=1.0)
                self._producer.poll()
            except Exception:  # noqa: BLE001 - a dead broker on exit is expected
                pass
            self._reap_in_flight()
            self._reap_resend()  # journal records stay there until acknowledged
        older = []
        for item in self._in_flight:
            if item.future.succeeded():
                self._sent += 1
            else:
                older.append((item.topic, item.key, item.value))
        self._journal.prepend(older)
        self._in_flight.clear()
        self._spilled += len(older)
        if older and not self._told:
            self._tell_undelivered()
        with self._order_lock:
            self._queue_to_journal()
        if self._producer is not None:
            try:
                self._producer.close(timeout=1.0)
            except Exception:  # noqa: BLE001
                pass


def bootstrap_reachable(servers: list[str], timeout: float = 1.0) -> bool:
    """True when one of the `host:port` servers accepts a TCP connection (a cheap check before a Kafka client)."""
    for server in servers:
        host, _, port = server.rpartition(":")
        try:
            with socket.create_connection((host or "localhost", int(port or 9092)), timeout=timeout):
                return True
        except (OSError, ValueError):
            continue
    return False


# ------------------------------------------------------------ at exit

_OPEN: weakref.WeakSet[Publisher] = weakref.WeakSet()
_HOOKED = False


def _close_at_exit(publisher: Publisher) -> None:
    global _HOOKED
    _OPEN.add(publisher)
    if not _HOOKED:
        atexit.register(_close_open_publishers)
        os.register_at_fork(after_in_child=_OPEN.clear)  # a forked child has no sender thread to wait for
        _HOOKED = True


def _close_open_publishers() -> None:
    """Events published before a normal exit are delivered, or journaled when the broker is away."""
    for publisher in list(_OPEN):
        try:
            publisher.close(publisher.exit_timeout_s, journaled_ok=True)
        except Exception:  # noqa: BLE001 - exit must go on; the journal keeps what is written
            log.exception("publisher: closing at exit failed")
