"""Read topics from the start to the end they had when the read began: no guessing with a consumer timeout.

A one-pass `for message in KafkaConsumer(..., consumer_timeout_ms=N)` ends early when
the first fetch is slower than N (a loaded machine, a JVM pause), and then a test
sees a partial topic.
"""

from __future__ import annotations

import time

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord


def read_to_end(bootstrap: str, *topics: str, timeout: float = 60.0) -> list[ConsumerRecord]:
    """Every message of `topics` up to their current ends, in order per partition."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    deadline = time.monotonic() + timeout
    try:
        tps = []
        for topic in topics:
            while (partitions := consumer.partitions_for_topic(topic)) is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"topic {topic} has no partitions after {timeout:g} s")
                time.sleep(0.2)
            tps += [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        out: list[ConsumerRecord] = []
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            if time.monotonic() > deadline:
                raise AssertionError(f"read {len(out)} messages of {sum(ends.values())} in {timeout:g} s")
            for records in consumer.poll(timeout_ms=500).values():
                out += records
        return out
    finally:
        consumer.close()
