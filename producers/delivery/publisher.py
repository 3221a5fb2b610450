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
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from areal_metrics.producers.delivery import backends as delivery
from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.deadletter import rejected
from areal_metrics.producers.contract.events import Event
from areal_metrics.producers.contract.limits import default_limits
from areal_metrics.producers.delivery.journal import Journal, open_journal
from areal_metrics.producers.delivery.publisher_core import Message, PublisherCore
from areal_metrics.producers.contract.settings import Settings, state_dir, read_setting
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.producers.runtime.kafka_wait import bootstrap_reachable

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.02  # how long the sender sleeps when idle: rare wake-ups leave the GIL to training
_JOURNAL_RETRY_S = 1.0  # after a failed journal write (a full disk), the next try


# The largest record the producer sends (kafka-python's max_request_size and a broker's message.max.bytes, by
# default), and what a record batch adds to its key and value (headers, lengths, CRC: under 100 bytes)
SEND_MAX_BYTES = 1 << 20
RECORD_OVERHEAD_BYTES = 256
LETTER_RAW_BYTES = 64 * 1024  # of a message too large to send, what its dead letter keeps (base64 at worst: 4/3)
_HOST = (os.uname().nodename if hasattr(os, "uname") else "client")[:256]


def record_room(key: bytes) -> int:
    """The most bytes a message's value may have with this key: readers' AREAL_MAX_MESSAGE_BYTES, at most
    what the producer sends, less what a record batch adds."""
    return min(default_limits().max_bytes, SEND_MAX_BYTES) - RECORD_OVERHEAD_BYTES - len(key)


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
    lost: int = 0  # not delivered and not kept: the journal could not be written (a full disk), or published after close


class Publisher:
    """The shell around `PublisherCore`: the sender thread, the Kafka client, the journal file."""

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
        uninterrupted: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        """`uninterrupted`: around what the caller's thread does under the publisher's locks (a full queue's
        chunk to the journal), a context in which a terminating signal's handler, which runs on that thread
        and would finish the run there, waits for it to end (the client's `exit_hooks.finishing`): taking
        the same locks again there hung the process."""
        self._uninterrupted = uninterrupted
        self.topics = topics or Topics(read_setting("topic_prefix"))
        self._delivery_timeout_s = delivery_timeout_s
        self._kafka_config = {"bootstrap_servers": bootstrap.split(","), **(kafka_config or {})}
        codec = self._kafka_config.get("compression_type")
        problem = delivery.compression_problem(codec, kafka_client)
        if problem is not None:  # before anything is opened: a misconfiguration stops here, in one line
            raise ConfigError(f"AREAL_KAFKA_COMPRESSION={codec}: {problem}")
        if kafka_client not in delivery.CLIENTS:
            raise ValueError(f"kafka_client {kafka_client!r}: expected one of {', '.join(delivery.CLIENTS)}")
        self._journal = open_journal(Path(journal_dir or state_dir() / "journal" / "default"), fsync=fsync_journal)
        self._client = kafka_client
        # Set: the first event that goes to the journal says so once on stderr (the client's users see it).
        self._origin = bootstrap_origin
        self._told = False
        self._warned: set[str] = set()  # what was said once (per outage for the broker's, see _say_once)
        self._after_close = 0  # publish() calls after close(): dropped
        self._journal_broken_until = 0.0  # a write to the journal failed: none is tried before this
        self._producer: delivery.Producer | None = None
        self._order_lock = threading.Lock()  # the journal is appended in publish order
        self._core: PublisherCore[Event | Outgoing] = PublisherCore(
            _Port(self), max_queue=max_queue, max_in_flight=max_in_flight, stall_s=stall_s, order=self._order_lock)
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

    @property
    def max_queue(self) -> int:
        return self._core.max_queue

    # ------------------------------------------------------------ caller side

    def publish(self, event: Event | Outgoing) -> None:
        """Enqueue and return at once. Never raises: after close() (another thread of the caller
        logging while it finishes) the event is dropped, counted in `stats().lost`, and said once."""
        if self._closing:
            self._after_close += 1
            self._say_once("after-close", "publisher: an event was published after close() and is dropped "
                           "(counted in stats().lost)")
            return
        if self._core.enqueue(event):
            return
        # Memory is full (the sender is stuck): the queue's oldest go to the journal, a chunk
        # at a time, so the order per run holds and no call pays for the whole queue.
        with self._uninterrupted(), self._order_lock:
            self._core.make_room(event)

    def flush(self, timeout: float = 30.0, *, journaled_ok: bool = False) -> bool:
        """Wait until everything published so far is acknowledged; False on timeout.

        `journaled_ok`: also done once the broker is away (no connection) and
        everything is in the journal (what exit wants: delivered or on disk).
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._core.idle(connected=self._producer is not None, journal_pending=self._journal.has_pending(),
                               journaled_ok=journaled_ok):
                return True
            if self._stopped.is_set():
                return False
            self._wake.set()
            time.sleep(0.005)
        return False

    def close(self, timeout: float = 10.0, *, journaled_ok: bool = False, join_s: float | None = None) -> None:
        """Flush for up to `timeout`; whatever is still unsent stays in the journal for the next start.
        `join_s`: how long to wait for a sender stuck in the Kafka client then (`max(timeout, 5)`)."""
        with self._close_lock:  # one closer: a second (atexit beside the caller's) returns at once
            if self._close_started:
                return
            self._close_started = True
        try:
            self.flush(timeout, journaled_ok=journaled_ok)
        except BaseException:  # Ctrl-C while exit waits for the broker: what is unsent goes to disk, then it goes on
            self._close_now(join_s=1.0)
            raise
        self._close_now(join_s=max(timeout, 5.0) if join_s is None else join_s)

    def _close_now(self, join_s: float) -> None:
        """Stop the sender (waiting `join_s` for it) and journal whatever it leaves."""
        self._closing = True
        _OPEN.discard(self)
        self._wake.set()
        self._thread.join(timeout=join_s)
        if self._thread.is_alive():
            # The sender is stuck inside the Kafka client (e.g. a handshake that keeps
            # failing): journal what is in flight and queued from here, and let the thread go.
            with self._order_lock:
                self._abandoned = True
                self._core.abandon()
        else:
            with self._order_lock:  # a publish() that passed its check as close began, after the sender's last drain
                self._core.journal_queue()
        self._journal.close()

    def stats(self) -> PublisherStats:
        core = self._core
        return PublisherStats(
            queued=core.queued,
            sent=core.sent,
            spilled=core.spilled,
            resent=core.resent,
            failed=core.failed,
            pending=core.pending + (1 if self._journal.has_pending() else 0),
            lost=core.lost + self._after_close,
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

    def _spill(self, message: Message) -> bool:
        if self._journal_broken_until and time.monotonic() < self._journal_broken_until:
            return False  # failed a moment ago: a full queue is not retried write by write
        try:
            self._journal.append(*message)
        except OSError as exc:
            self._journal_unwritable(exc)
            return False
        self._journal_broken_until = 0.0
        if not self._told:
            self._tell_undelivered()
        return True

    def _journal_unwritable(self, exc: OSError) -> None:
        """The journal cannot be written (a full disk, a quota): what the broker does not take in the
        next second is dropped without a try, and counted; said once per publisher."""
        self._journal_broken_until = time.monotonic() + _JOURNAL_RETRY_S
        if "journal" in self._warned:
            return
        self._warned.add("journal")
        message = (f"areal-metrics: cannot write the journal {self._journal.directory} ({exc}); events the broker "
                   "does not take are dropped until it can be written (counted in run.stats().lost)")
        self._tell(message, logging.WARNING)

    def _say_once(self, what: str, message: str, *args: Any) -> None:
        """`message` at WARNING the first time `what` happens, at DEBUG after (until `_said_enough(what)`)."""
        if what in self._warned:
            log.debug(message, *args)
        else:
            self._warned.add(what)
            log.warning(message, *args)

    def _said_enough(self, *whats: str) -> None:
        """The broker answers again: the next outage is said again."""
        self._warned.difference_update(whats)

    def _tell_undelivered(self) -> None:
        """Once per publisher: events are not reaching the broker; where they wait, how to send them."""
        self._told = True
        bootstrap = ",".join(self._kafka_config["bootstrap_servers"])
        origin = f" ({self._origin})" if self._origin else ""
        message = (f"areal-metrics: cannot deliver to the Kafka broker at {bootstrap}{origin}; events are kept in "
                   f"the journal {self._journal.directory} and re-sent when it answers (or: areal-metrics sync)")
        self._tell(message, logging.INFO)  # a publisher of the CLI or a service: its caller reports delivery

    def _tell(self, message: str, service_level: int) -> None:
        """`message` on the client's user's stderr (and in their logging, when they set one up); a
        publisher of the CLI or a service (no `bootstrap_origin`) logs it at `service_level`."""
        if self._origin is not None:
            print(message, file=sys.stderr, flush=True)
            if log.hasHandlers():  # the user's logging gets it too; without handlers stderr has it already
                log.warning(message)
        else:
            log.log(service_level, message)

    def _run(self) -> None:
        try:
            while not self._closing:
                try:
                    worked = self._step()
                except Exception as exc:  # noqa: BLE001 - one failed round (a journal read, a client's
                    # bug) must not end delivery for the rest of the run: said once, tried again a second later
                    self._say_once(f"step-{type(exc).__name__}", "publisher: a round of delivery failed (%s: %s); "
                                   "trying again", type(exc).__name__, exc)
                    self._wake.wait(1.0)
                    self._wake.clear()
                    continue
                if not worked:
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
            self._shutdown()
        except Exception:  # the sender must never die silently: log, keep what is left
            log.exception("publisher sender thread failed; unsent events stay in the journal")
            self._shutdown()
        finally:
            self._stopped.set()

    def _step(self) -> bool:
        """One round of work (`PublisherCore.step`); True when something was done."""
        if self._producer is not None:
            self._producer.poll()
        return self._core.step()

    def _encode(self, item: Event | Outgoing) -> Message:
        if isinstance(item, Event):
            message = self.topics.for_event(item), item.run_id.encode(), item.to_json()
        else:
            message = item.encode(self.topics)
        return self._sendable(message)

    def _sendable(self, message: Message) -> Message:
        """`message`, or its dead letter when it is larger than a record may be: the producer refuses such a
        message at every try, and in the journal it would hold back every record behind it for good."""
        topic, key, value = message
        room = record_room(key)
        if len(value) <= room:
            return message
        reason = (f"client: a message for {topic} of {len(value)} bytes is larger than a record may be ({room} "
                  "bytes: AREAL_MAX_MESSAGE_BYTES, at most the producer's 1 MiB); sent as this dead letter")
        self._say_once(f"too-large:{topic}", "publisher: %s", reason)
        # the letter keeps the message's first bytes: its raw text counts characters, up to 4 bytes each
        letter = rejected(value[:LETTER_RAW_BYTES], reason, topic, node=_HOST, key=key)
        return self.topics.deadletter, key, letter.to_json()

    def _connect(self) -> bool:
        if not self._bootstrap_reachable():
            return False
        try:
            self._producer = delivery.create(self._kafka_config, self._client,
                                             delivery_timeout_s=self._delivery_timeout_s)
        except delivery.SendError as exc:  # said once an outage: the sender tries again every few seconds
            self._say_once("connect", "publisher: no producer (%s); journaling", exc)
            return False
        except Exception:  # a bad setting: say so, keep journaling, never kill the sender
            if "connect-error" not in self._warned:
                self._warned.add("connect-error")
                log.exception("publisher: cannot create the Kafka producer; journaling")
            return False
        self._said_enough("connect", "connect-error", "send", "resend")
        return True

    def _bootstrap_reachable(self) -> bool:
        return bootstrap_reachable(self._kafka_config["bootstrap_servers"])

    def _send(self, message: Message, *, resend: bool) -> delivery.Delivery | None:
        """The client's delivery of one message; None when it refused it (the core journals it). A journal
        record too large to send (written by a client before the size check) goes as its dead letter."""
        assert self._producer is not None
        try:
            return self._producer.send(*(self._sendable(message) if resend else message))
        except delivery.SendError as exc:  # metadata or buffer timeout: the broker is away
            if resend:
                self._say_once("resend", "publisher: re-send from journal failed (%s); retrying later", exc)
            else:
                self._say_once("send", "publisher: send failed (%s); journaling", exc)
            return None

    def _prepend(self, messages: list[Message]) -> bool:
        try:
            self._journal.prepend(messages)
        except OSError as exc:
            self._journal_unwritable(exc)
            return False
        if not self._told:
            self._tell_undelivered()
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
        self._core.close()
        if self._producer is not None:
            try:
                self._producer.close(timeout=1.0)
            except Exception:  # noqa: BLE001
                pass


class _Port:
    """The Publisher's I/O as its core asks for it (`publisher_core.Port`)."""

    def __init__(self, publisher: Publisher) -> None:
        self._p = publisher
        self.encode = publisher._encode
        self.append = publisher._spill
        self.prepend = publisher._prepend
        self.connect = publisher._connect
        self.send = publisher._send
        self.journal_pending = publisher._journal.has_pending
        self.read = publisher._journal.read
        self.advance = publisher._journal.advance

    def connected(self) -> bool:
        return self._p._producer is not None


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
    """Events published before a normal exit are delivered, or journaled when the broker is away. A
    Ctrl-C while exit waits ends the wait: what is unsent is journaled, and the process exits."""
    interrupted = False
    for publisher in list(_OPEN):
        try:
            if interrupted:
                publisher.close(0, journaled_ok=True, join_s=1.0)
            else:
                publisher.close(publisher.exit_timeout_s, journaled_ok=True)
        except KeyboardInterrupt:
            interrupted = True
            print(f"areal-metrics: interrupted while delivering at exit; what is unsent is kept in the journal "
                  f"{publisher.journal.directory} (areal-metrics sync sends it)", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - exit must go on; the journal keeps what is written
            log.exception("publisher: closing at exit failed")
