"""Kafka messages of one chunk -> rows to store and dead letters to publish (pure).

Each topic carries one event type (`Topics.event_type`). A message that fails
validation becomes a `rejected` event whose `event_id` is derived from its log
position, so a chunk decoded twice (a retry after a crash) gives the same dead
letter, which deduplicates downstream. A bad message read FROM the dead-letter
topic is stored directly in `deadletter` (never re-published: that would loop).
A valid event that no column could hold (an integer beyond UInt32, say) is
dead-lettered too: storing it would fail on every retry.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from areal_metrics.producers.contract.deadletter import letter_ts, rejected
from areal_metrics.producers.contract.events import Event, RejectedEvent, ValidationError, parse_event
from areal_metrics.producers.contract.topics import Topics

from areal_metrics.sinks.rows import Located, unstorable

SINK_NODE = f"sink@{socket.gethostname()}"[:128]


class Message(Protocol):
    """The parts of a Kafka record the sink reads (kafka-python's ConsumerRecord has them)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int  # ms since the epoch, set by the producer or the broker


@dataclass(slots=True)
class Decoded:
    rows: list[Located] = field(default_factory=list)  # all of one table: the topic's
    dead_letters: list[RejectedEvent] = field(default_factory=list)  # to publish


def dead_letter_id(topic: str, partition: int, offset: int) -> str:
    """The deterministic event_id of the dead letter for one log position."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"areal-sink:{topic}:{partition}:{offset}").hex


def dead_letter(m: Message, reason: str, node: str = SINK_NODE) -> RejectedEvent:
    """The `rejected` event of message `m`: its id and time from the log position, so a second
    decode (or a second bisection of its chunk) gives the same record."""
    raw = m.value if m.value is not None else b""
    bad = rejected(raw, reason, m.topic, node=node, key=m.key)
    ts = letter_ts(max(0, getattr(m, "timestamp", 0) or 0) / 1000.0)
    return bad.replace(event_id=dead_letter_id(m.topic, m.partition, m.offset), ts=ts)


def decode(messages: Iterable[Message], topics: Topics, node: str = SINK_NODE) -> Decoded:
    out = Decoded()
    for m in messages:
        expected: type[Event] = topics.event_type(m.topic)
        raw = m.value if m.value is not None else b""
        try:
            if not raw:
                raise ValidationError("event", "empty message")
            event = parse_event(raw, expected=expected)
            why = unstorable(event)
            if why is not None:
                raise ValidationError(*why.split(": ", 1))
        except ValidationError as exc:
            bad = dead_letter(m, str(exc), node)
            if m.topic == topics.deadletter:
                out.rows.append(Located(bad, m.topic, m.partition, m.offset))
            else:
                out.dead_letters.append(bad)
            continue
        out.rows.append(Located(event, m.topic, m.partition, m.offset))
    return out
