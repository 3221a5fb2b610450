"""The session broker is a real Kafka broker: produce and consume through it."""

import pytest
from kafka import KafkaConsumer, KafkaProducer

pytestmark = pytest.mark.broker


def test_real_broker_round_trip(kafka_bootstrap, topics):
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    producer.send(topics.steps, key=b"run-1", value=b'{"hello": 1}').get(timeout=30)
    producer.close()
    consumer = KafkaConsumer(
        topics.steps, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
        consumer_timeout_ms=10_000,
    )
    values = [m.value for m in consumer]
    consumer.close()
    assert values == [b'{"hello": 1}']


def test_topics_have_three_partitions(kafka_bootstrap, topics):
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap)
    try:
        for name in topics.all():
            assert consumer.partitions_for_topic(name) == {0, 1, 2}
    finally:
        consumer.close()
