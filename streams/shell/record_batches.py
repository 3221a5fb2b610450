"""A batch's messages to the transport producer as record batches, one per partition.

aiokafka's `send()` costs a future, its callbacks, a metadata check and an accumulator
lookup per message; `create_batch()` + `send_batch()` cost less per message (`python -m
benchmarks.bench_streams` compares the two: "send cost"). `send_in_batches` groups messages by (topic,
partition), keeps their order within a partition, fills closed batches (the sender takes
them at once, without waiting out the linger) and gives back one awaitable per message:
its batch's delivery. The batches join the same accumulator as `send()`'s, so the
producer's flush before an offset commit covers them.

A message's partition is the one `send()` would pick: the producer's partitioner over
the key (the same murmur2 as every Kafka client's default), unless the message names one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any

from aiokafka.errors import (
    CorruptRecordException,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)

from areal_metrics.producers.contract.errors import ArealError
from areal_metrics.streams.shell.faust_internals import partition_for

# (topic, partition or None for "by the key", key, value or None for a tombstone)
Message = tuple[str, "int | None", bytes, "bytes | None"]

# Kafka's record batch (v2): a header, then per record its framing (varints of its length, time and offset
# deltas, key and value lengths; at most 32 bytes) beside its key and value
BATCH_HEADER, RECORD_FRAMING = 61, 32


async def send_in_batches(producer: Any, messages: Sequence[Message],
                          max_batch_bytes: int | None = None) -> list[Awaitable[Any]]:
    """`producer` is a started aiokafka AIOKafkaProducer. Each message's awaitable completes
    when the broker has it (or raises what the batch's delivery raised). `max_batch_bytes`: a
    record batch holds at most about that many bytes (the topic's max.message.bytes bounds a whole
    batch, and the producer fills one up to its own batch size), one record alone excepted."""
    groups: dict[tuple[str, int], list[int]] = {}
    known: set[str] = set()
    by_key: dict[tuple[str, bytes], int] = {}  # a key's partition, once per call (a run's outputs share one)
    for i, (topic, partition, key, _) in enumerate(messages):
        if topic not in known:  # the topic's metadata, as send() and send_batch() wait for it
            await producer.partitions_for(topic)
            known.add(topic)
        if partition is None:
            if key is None:  # no key: the partitioner's own choice, per message
                partition = partition_for(producer, topic, key)
            else:
                partition = by_key.get((topic, key))
                if partition is None:  # what send() calls (murmur2 in pure Python: worth doing once a key)
                    partition = by_key[(topic, key)] = partition_for(producer, topic, key)
        groups.setdefault((topic, partition), []).append(i)
    delivered: list[Awaitable[Any]] = [None] * len(messages)  # type: ignore[list-item]
    for (topic, partition), indexes in groups.items():
        batch, members, size = producer.create_batch(), [], BATCH_HEADER
        for i in indexes:
            _, _, key, value = messages[i]
            record = len(key) + len(value or b"") + RECORD_FRAMING
            if members and max_batch_bytes is not None and size + record > max_batch_bytes:
                await _submit(producer, batch, topic, partition, members, delivered)
                batch, members, size = producer.create_batch(), [], BATCH_HEADER
            size += record
            if batch.append(key=key, value=value, timestamp=None) is None:  # full: send it, start the next
                await _submit(producer, batch, topic, partition, members, delivered)
                size = BATCH_HEADER + record
                batch, members = producer.create_batch(), []
                if batch.append(key=key, value=value, timestamp=None) is None:  # pragma: no cover
                    raise RuntimeError(f"{topic}: a record an empty batch does not take")
            members.append(i)
        await _submit(producer, batch, topic, partition, members, delivered)
    return delivered


async def _submit(producer: Any, batch: Any, topic: str, partition: int, members: list[int],
                  delivered: list[Awaitable[Any]]) -> None:
    batch.close()  # no more records: the sender takes it now instead of after the linger
    future = await producer.send_batch(batch, topic, partition=partition)
    for i in members:
        delivered[i] = future


class RecordRefused(ArealError):
    """The broker refused a record for what it is (too large, corrupt): the message behind it is at fault,
    and failing again on it is what the crash guard turns into a dead letter."""


class DeliveryFailed(ArealError):
    """A delivery failed for the transport's sake (a broker away past the producer's timeout, a leader
    lost): no message is at fault, so a stop for it must not count towards a poison message."""


# the broker's answers about the record itself; any other failure is the transport's
_REFUSED = (MessageSizeTooLargeError, RecordListTooLargeError, RecordTooLargeError, CorruptRecordException)


async def deliver(producer: Any, messages: Sequence[Message], max_batch_bytes: int | None = None) -> None:
    """`send_in_batches`, then wait until the broker has every batch: raises what a delivery raised.
    For the worker's state (the table's changelog): a record the broker refuses (one over the topic's
    `max.message.bytes`) must stop the batch that wrote it, not vanish; the producer's flush before an
    offset commit waits for it but says nothing of a failure, so the inputs would be committed past a
    state that was never kept. `RecordRefused`: the crash guard then takes the batch apart and
    dead-letters the message that keeps failing (producers/runtime/poison.py); `DeliveryFailed`: the
    worker stops without blaming the batch (`CrashGuard.abandon`) and reads it again once restarted."""
    delivered = await send_in_batches(producer, messages, max_batch_bytes)
    await settled({id(d): d for d in delivered}.values())  # one awaitable a batch, shared by its messages


async def settled(awaitables: Iterable[Awaitable[Any]]) -> None:
    """Wait for each delivery; a failure raised as whose fault it was (`RecordRefused` or `DeliveryFailed`):
    the worker's changelog and the outputs it must see delivered (alerts, commands) fail alike."""
    try:
        for delivery in awaitables:
            await delivery
    except _REFUSED as exc:
        raise RecordRefused(f"{type(exc).__name__}: {exc}") from exc
    except (KafkaError, OSError, asyncio.TimeoutError) as exc:
        raise DeliveryFailed(f"{type(exc).__name__}: {exc}") from exc
