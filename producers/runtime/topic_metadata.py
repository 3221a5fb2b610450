"""What a kafka-python consumer's metadata knows of topics' partitions, waited for; and the
partition a key maps to.

`KafkaConsumer.partitions_for_topic` fetches metadata for a topic it does not
know, but answers an empty set (never None) while the broker has no partitions
to report: a topic not created yet. A caller that takes that answer at face
value assigns itself nothing (the control feed once did, and read no command);
a group member that joins before its metadata is in may be given nothing (the
sink once was).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any


def known_partitions(consumer: Any, topics: Sequence[str], timeout_s: float,
                     stop: threading.Event | None = None) -> dict[str, set[int]]:
    """Each topic's partitions once the consumer's metadata has them; after `timeout_s` (or `stop`), those found."""
    deadline = time.monotonic() + timeout_s
    found: dict[str, set[int]] = {}
    while True:
        for topic in topics:
            if topic not in found and (partitions := consumer.partitions_for_topic(topic)):
                found[topic] = set(partitions)
        if len(found) == len(set(topics)) or time.monotonic() >= deadline or (stop is not None and stop.is_set()):
            return found
        if stop is not None:
            stop.wait(0.2)
        else:
            time.sleep(0.2)


def key_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives `key` among `partitions` (murmur2, as the Java
    client, kafka-python, aiokafka and our publisher's librdkafka setting compute it): where a run's
    events are when keyed by its run_id (CONTRACT.md)."""
    from kafka.partitioner.default import murmur2

    return (murmur2(key) & 0x7FFFFFFF) % partitions
