"""The worker's consumer (areal_metrics.streams.shell.faust_internals) hands a fetch over, on Faust's real objects.

No broker: the app is built as the worker builds it, and its consumer is created but not
started. What the broker tests cannot see from outside is checked here: a hand-over
tracks each message as unacknowledged (so a rebalance or shutdown waits for it), records
the partition's inbound time (Faust's check for a stream that stopped processing reads
it), and drops a fetch taken before a rebalance began (it is read again from the
committed offsets).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from faust.types import TP, Message

from areal_metrics.producers.contract.topics import Topics
from areal_metrics.streams.shell.app import build_worker, repartition_topic_for
from areal_metrics.streams.shell.faust_internals import BatchConsumer

TOPICS = Topics("handover.")


def message(tp: TP, offset: int) -> Message:
    return Message(tp.topic, tp.partition, offset, time.time(), 0, None, b"r1", b"{}", None, tp=tp)


def test_a_fetch_is_handed_over_tracked_and_timed_and_a_stale_one_dropped(tmp_path: Path) -> None:
    worker = build_worker(bootstrap="127.0.0.1:9", topics=TOPICS, datadir=tmp_path)
    worker.app.finalize()
    consumer = worker.app.consumer
    assert isinstance(consumer, BatchConsumer)
    raw = {TOPICS.steps, TOPICS.evals, TOPICS.runs, TOPICS.acks}  # and their repartition topics (test_streams_rerouting)
    assert set(worker.app.batch_inputs[0]) == raw | {repartition_topic_for(TOPICS.prefix, t) for t in raw}
    steps, evals = TP(TOPICS.steps, 1), TP(TOPICS.evals, 2)
    delivered: list[list[Message]] = []

    async def deliver(batch: list[Message]) -> None:
        delivered.append(batch)

    async def go() -> None:
        generation = worker.app.consumer_generation_id
        fetch = [message(steps, 5), message(evals, 9), message(steps, 6)]
        await consumer._hand_over(fetch, deliver, generation)
        assert delivered == [fetch]  # one list, in the fetch's order
        assert all(m in consumer._unacked_messages for m in fetch)
        assert {steps, evals} <= set(worker.app.monitor.stream_inbound_time)

        stale = [message(steps, 7)]
        await consumer._hand_over(stale, deliver, generation - 1)  # taken before a rebalance began
        assert len(delivered) == 1 and stale[0] not in consumer._unacked_messages

    asyncio.run(go())


def test_ack_all_books_what_fausts_ack_books_one_message_at_a_time(tmp_path: Path) -> None:
    steps, ticks = TP(TOPICS.steps, 0), TP("handover.not-acked", 0)
    books = []
    for name, ack_all in (("faust", False), ("ack_all", True)):
        worker = build_worker(bootstrap="127.0.0.1:9", topics=TOPICS, datadir=tmp_path / name)
        worker.app.finalize()
        consumer = worker.app.consumer
        consumer.app.topics._acking_topics.add(TOPICS.steps)  # as once the worker subscribed
        consumer._committed_offset[steps] = 3  # offsets below it were committed already
        fetch = [message(steps, 2), message(steps, 3), message(steps, 4), message(ticks, 7)]
        again = message(steps, 4)  # a second message for offset 4 (read again after a seek)
        for m in fetch:
            consumer.track_message(m)
        if ack_all:
            consumer.ack_all([*fetch, fetch[1], again])
        else:
            for m in [*fetch, fetch[1], again]:
                consumer.ack(m)
        books.append((dict(consumer._acked), dict(consumer._acked_index), consumer._n_acked,
                       sorted(m.offset for m in consumer._unacked_messages), [m.acked for m in [*fetch, again]]))
    assert books[0] == books[1]
    assert books[1][0] == {steps: [3, 4]} and books[1][2] == 2
