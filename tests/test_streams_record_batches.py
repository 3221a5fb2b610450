"""The worker's record batches (areal_metrics.streams.shell.record_batches) against the real broker: every
message lands where aiokafka's own send() puts it, in its order, whole."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest
from aiokafka import AIOKafkaProducer
from kafka import KafkaConsumer

from areal_metrics.stack.kafka_broker import create_topics
from areal_metrics.streams.shell.record_batches import send_in_batches

pytestmark = pytest.mark.broker

PARTITIONS = 5
BATCH_BYTES = 2048  # small, so that one partition's messages fill several batches


def _read_all(bootstrap: str, topic: str, expected: int) -> list:
    consumer = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             consumer_timeout_ms=10_000, max_partition_fetch_bytes=4 * 1024 * 1024)
    try:
        records = []
        for m in consumer:
            records.append(m)
            if len(records) >= expected:
                break
        return records
    finally:
        consumer.close()


async def _send_both(bootstrap: str, batched: str, one_by_one: str, messages: list) -> tuple[list, list]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", max_batch_size=BATCH_BYTES,
                                max_request_size=4 * 1024 * 1024)
    await producer.start()
    try:
        delivered = await send_in_batches(producer, [(batched, p, k, v) for p, k, v in messages])
        metadata = [await fut for fut in delivered]
        for p, k, v in messages:  # the reference: aiokafka's per-message path
            await (await producer.send(one_by_one, v, key=k, partition=p))
        return delivered, metadata
    finally:
        await producer.stop()


def test_each_message_lands_where_send_puts_it_in_order_and_whole(kafka_bootstrap: str) -> None:
    rng = random.Random(7)
    name = f"rb{uuid.uuid4().hex[:8]}"
    batched, one_by_one = f"{name}.batched", f"{name}.reference"
    create_topics(kafka_bootstrap, [batched, one_by_one], partitions=PARTITIONS)
    keys = [f"run-{i}".encode() for i in range(40)] + ["rün-✓".encode(), b"\x00\xff", b""]
    messages: list[tuple[int | None, bytes, bytes | None]] = []
    for i in range(400):
        key = rng.choice(keys)
        messages.append((None, key, f'{{"i": {i}, "pad": "{"x" * rng.randint(0, 300)}"}}'.encode()))
    messages.insert(37, (None, b"run-big", b"B" * (BATCH_BYTES * 8)))  # larger than an empty batch
    messages.insert(90, (3, b"run-0", None))  # a tombstone, to a partition it names
    messages.insert(91, (0, b"run-0", b"named"))

    delivered, metadata = asyncio.run(_send_both(kafka_bootstrap, batched, one_by_one, messages))

    assert len(delivered) == len(messages)
    assert len({id(f) for f in delivered}) > PARTITIONS  # several batches per partition
    got = _read_all(kafka_bootstrap, batched, len(messages))
    want = _read_all(kafka_bootstrap, one_by_one, len(messages))
    assert len(got) == len(want) == len(messages)

    def by_partition(records: list) -> dict[int, list[tuple[bytes, bytes | None]]]:
        out: dict[int, list[tuple[bytes, bytes | None]]] = {}
        for r in sorted(records, key=lambda r: (r.partition, r.offset)):
            out.setdefault(r.partition, []).append((r.key, r.value))
        return out

    # The same partitions, each with the same messages in the same order, as send() gave.
    assert by_partition(got) == by_partition(want)
    assert {r.partition for r in got} == set(range(PARTITIONS))
    named = {(r.partition, r.value) for r in got if r.key == b"run-0" and r.value in (None, b"named")}
    assert named == {(3, None), (0, b"named")}
    big = [r for r in got if r.key == b"run-big"]
    assert len(big) == 1 and big[0].value == b"B" * (BATCH_BYTES * 8)
    # A message's awaitable is its batch's delivery, on its partition.
    placed = {(r.key, r.value): r.partition for r in got}
    for (_, key, value), meta in zip(messages, metadata):
        assert meta.topic == batched and meta.partition == placed[(key, value)]


def test_nothing_to_send_sends_nothing() -> None:
    class NoProducer:
        def __getattr__(self, name: str):  # any use of the producer fails the test
            raise AssertionError(f"producer.{name} used for no messages")

    assert asyncio.run(send_in_batches(NoProducer(), [])) == []


def test_a_record_the_broker_refuses_is_an_error_of_deliver_where_send_in_batches_only_loses_it(kafka_bootstrap: str) -> None:
    """The worker's state record for a vote round holds every node's verdicts: three results of 100k
    verdicts are ~2.4 MB, over a topic's default max.message.bytes (1 MB). Its batch's awaitable fails,
    and the changelog used to drop that awaitable: the state was lost and the inputs committed anyway."""
    from aiokafka.errors import KafkaError

    from areal_metrics.streams.shell.record_batches import RecordRefused, deliver

    topic = f"rb{uuid.uuid4().hex[:8]}.changelog"
    create_topics(kafka_bootstrap, [topic], partitions=1)
    big = (topic, 0, b"run-1", b"v" * (2 * 1024 * 1024))

    async def go() -> tuple[BaseException | None, BaseException | None]:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=8 * 1024 * 1024)
        await producer.start()
        try:
            [fut] = await send_in_batches(producer, [big])  # returns at once: nothing says it failed
            lost = None
            try:
                await fut
            except KafkaError as exc:
                lost = exc
            try:
                await deliver(producer, [(topic, 0, b"run-1", b"small"), big])
            except RecordRefused as exc:  # the record's fault: the crash guard's to dead-letter
                return lost, exc.__cause__
            return lost, None
        finally:
            await producer.stop()

    bootstrap = kafka_bootstrap
    lost, raised = asyncio.run(go())
    assert lost is not None and raised is not None and type(raised) is type(lost)
    assert asyncio.run(_deliver_small(bootstrap, topic)) is None  # a record within the limit is delivered


async def _deliver_small(bootstrap: str, topic: str) -> None:
    from areal_metrics.streams.shell.record_batches import deliver

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        return await deliver(producer, [(topic, 0, b"run-1", b"small")])
    finally:
        await producer.stop()


def test_record_batches_cut_at_max_batch_bytes_fit_a_topic_whose_limit_is_below_the_producers_batch(
        kafka_bootstrap: str) -> None:
    """The broker's max.message.bytes bounds a whole record batch, and the producer fills one up to its own batch
    size (the worker's: 256 KiB): on a changelog with a smaller limit, records each within it were refused
    together. Cut at the limit, they are delivered."""
    from aiokafka.errors import KafkaError

    from areal_metrics.producers.contract.topics import TopicSpec
    from areal_metrics.streams.shell.record_batches import RecordRefused, deliver

    limit = 5_000
    topic = f"rb{uuid.uuid4().hex[:8]}.small"
    create_topics(kafka_bootstrap, [TopicSpec(topic, 1, {"max.message.bytes": str(limit)})], partitions=1)
    records = [(topic, 0, f"run-{i}".encode(), b"v" * 200) for i in range(100)]  # 20 KB in all, 0.2 KB each

    async def go(max_batch_bytes: int | None) -> BaseException | None:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", max_batch_size=256 * 1024)
        await producer.start()
        try:
            await deliver(producer, records, max_batch_bytes)
        except (RecordRefused, KafkaError) as exc:
            return exc
        finally:
            await producer.stop()
        return None

    assert isinstance(asyncio.run(go(None)), RecordRefused)
    assert asyncio.run(go(limit)) is None
    got = _read_all(kafka_bootstrap, topic, len(records))
    assert [(r.key, r.value) for r in got] == [(k, v) for _, _, k, v in records]
