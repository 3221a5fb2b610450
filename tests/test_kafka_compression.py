"""AREAL_KAFKA_COMPRESSION: parsed as a choice, used by both publisher backends, and on the wire.

Against the real broker: the publisher sends with the codec, the events read back equal, and the
record batches in the broker's log segment carry the codec in their attributes (bits 0-2 of the
v2 batch header: 1 gzip, 2 snappy, 3 lz4, 4 zstd), so the setting is not silently dropped.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.events import AlertEvent
from areal_metrics.producers.contract.settings import KAFKA_COMPRESSIONS, Settings
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.producers.delivery import backends
from areal_metrics.producers.delivery.publisher import Publisher

CODEC_IDS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


def test_the_setting_is_a_checked_choice() -> None:
    assert Settings.from_env({}).kafka_compression == "none"
    assert Settings.from_env({"AREAL_KAFKA_COMPRESSION": "ZSTD"}).kafka_compression == "zstd"
    with pytest.raises(ConfigError, match="AREAL_KAFKA_COMPRESSION='brotli': expected one of none, gzip"):
        Settings.from_env({"AREAL_KAFKA_COMPRESSION": "brotli"})
    assert set(KAFKA_COMPRESSIONS) == set(CODEC_IDS)
    # consumers share kafka_python_config: it must not carry a producer-only setting
    assert "compression_type" not in Settings.from_env({"AREAL_KAFKA_COMPRESSION": "gzip"}).kafka_python_config()
    assert backends.librdkafka_config({"compression_type": "zstd"}) == {"compression.type": "zstd"}


def test_a_codec_kafka_python_lacks_stops_with_the_variable_named(tmp_path: Path) -> None:
    import kafka.codec

    missing = [c for c, (check, _) in backends._KAFKA_PYTHON_CODECS.items() if not getattr(kafka.codec, check)()]
    for codec in KAFKA_COMPRESSIONS:
        problem = backends.compression_problem(codec, "kafka-python")
        assert (problem is not None) == (codec in missing), (codec, problem)
    if missing:
        settings = Settings.from_env({"AREAL_KAFKA_COMPRESSION": missing[0], "AREAL_KAFKA_CLIENT": "kafka-python",
                                      "AREAL_HOME": str(tmp_path)})
        with pytest.raises(ConfigError, match=f"AREAL_KAFKA_COMPRESSION={missing[0]}: kafka-python cannot compress"):
            Publisher.from_settings(settings, journal_dir=tmp_path / "journal", close_at_exit=False)


def _batch_codecs(log_dir: Path) -> list[int]:
    """The compression codec of every record batch in a partition's log segments."""
    codecs = []
    for segment in sorted(log_dir.glob("*.log")):
        data = segment.read_bytes()
        pos = 0
        while pos + 61 <= len(data):
            _base, length = struct.unpack_from(">qi", data, pos)
            magic = data[pos + 16]
            assert magic == 2, "not a v2 record batch"
            (attributes,) = struct.unpack_from(">h", data, pos + 21)
            codecs.append(attributes & 0x07)
            pos += 12 + length
    return codecs


def _cases() -> list[tuple[str, str]]:
    """(client, codec): kafka-python with what it can do here, confluent-kafka with the rest."""
    cases = [("kafka-python", c) for c in KAFKA_COMPRESSIONS if c != "none"
             and backends.compression_problem(c, "kafka-python") is None]
    if backends._confluent_available():
        cases += [("confluent-kafka", c) for c in KAFKA_COMPRESSIONS if c != "none"]
    return cases


@pytest.mark.broker
@pytest.mark.parametrize("client,codec", _cases())
def test_published_batches_are_compressed_with_the_codec(client: str, codec: str, kafka_broker, kafka_bootstrap: str,
                                                         tmp_path: Path) -> None:
    from kafka import KafkaConsumer

    from areal_metrics.stack.kafka_broker import create_topics

    topics = Topics(f"c{codec}{client[:2]}{tmp_path.name[-6:]}.".replace("_", ""))
    create_topics(kafka_bootstrap, [topics.alerts], partitions=1)
    settings = Settings.from_env({"AREAL_KAFKA_BOOTSTRAP": kafka_bootstrap, "AREAL_TOPIC_PREFIX": topics.prefix,
                                  "AREAL_KAFKA_COMPRESSION": codec, "AREAL_KAFKA_CLIENT": client,
                                  "AREAL_HOME": str(tmp_path)})
    publisher = Publisher.from_settings(settings, journal_dir=tmp_path / "journal", close_at_exit=False)
    sent = [AlertEvent(run_id="squeezed", kind="stalled", message="x" * 500, alert_id=f"a{i}") for i in range(50)]
    for event in sent:
        publisher.publish(event)
    assert publisher.flush(60)
    publisher.close()

    if backends.compression_problem(codec, "kafka-python") is None:  # a reader that has the codec reads it all
        consumer = KafkaConsumer(topics.alerts, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest",
                                 consumer_timeout_ms=10_000)
        got = [m.value for m in consumer]
        consumer.close()
        assert len(got) == len(sent) and all(b"squeezed" in v for v in got)
    codecs = _batch_codecs(kafka_broker.data_dir / "logs" / f"{topics.alerts}-0")
    assert codecs and set(codecs) == {CODEC_IDS[codec]}, codecs
    assert sum(1 for _ in codecs) < len(sent)  # batched: one codec header per batch, not per event
