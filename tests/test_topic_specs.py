"""How topics are created, from the settings (pure): replication, min ISR, retention per raw/derived topic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import DERIVED_SUFFIXES, TopicSpec, Topics, topic_spec
from areal_metrics.streams.shell.kafka_admin import TICKS_RETENTION_MS, changelog_spec, ticks_spec

TOPICS = Topics("x.")


def test_defaults_keep_every_topic_forever_on_one_replica() -> None:
    for spec in TOPICS.specs(Settings()):
        assert spec.replication_factor == 1
        assert spec.config == {"min.insync.replicas": "1", "retention.ms": "-1", "retention.bytes": "-1"}


def test_on_a_cluster_raw_topics_are_kept_and_derived_ones_expire_when_configured() -> None:
    settings = Settings(kafka_replication_factor=3, kafka_min_insync_replicas=2, derived_retention_ms=7 * 86_400_000)
    specs = {s.name: s for s in TOPICS.specs(settings)}
    assert set(specs) == set(TOPICS.all())
    for name, spec in specs.items():
        assert spec.replication_factor == 3 and spec.config["min.insync.replicas"] == "2"
        if name[len("x."):] in DERIVED_SUFFIXES:
            assert spec.config["retention.ms"] == "604800000" and "retention.bytes" not in spec.config
        else:
            assert spec.config["retention.ms"] == "-1" and spec.config["retention.bytes"] == "-1"


@pytest.mark.parametrize("settings, field", [
    (Settings(kafka_replication_factor=0), "AREAL_KAFKA_REPLICATION_FACTOR"),
    (Settings(kafka_replication_factor=3, kafka_min_insync_replicas=4), "AREAL_KAFKA_MIN_INSYNC_REPLICAS"),
    (Settings(kafka_min_insync_replicas=0), "AREAL_KAFKA_MIN_INSYNC_REPLICAS"),
    (Settings(raw_retention_ms=0), "AREAL_RAW_RETENTION_MS"),
    (Settings(derived_retention_ms=-5), "AREAL_DERIVED_RETENTION_MS"),
])
def test_values_kafka_would_refuse_name_the_setting(settings: Settings, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        TOPICS.specs(settings)


@given(rf=st.integers(1, 9), isr=st.integers(1, 9), raw=st.sampled_from([-1, 1, 3_600_000, 2**62]),
       derived=st.sampled_from([-1, 1, 86_400_000]))
def test_every_spec_follows_the_settings(rf: int, isr: int, raw: int, derived: int) -> None:
    settings = Settings(kafka_replication_factor=rf, kafka_min_insync_replicas=isr, raw_retention_ms=raw,
                        derived_retention_ms=derived)
    if isr > rf:
        with pytest.raises(ConfigError):
            TOPICS.specs(settings)
        return
    for spec in TOPICS.specs(settings):
        retention = derived if TOPICS.is_derived(spec.name) else raw
        assert (spec.replication_factor, spec.config["min.insync.replicas"]) == (rf, str(isr))
        assert spec.config["retention.ms"] == str(retention)
        assert ("retention.bytes" in spec.config) == (retention == -1)


def test_the_workers_ticks_are_replicated_like_derived_topics_but_kept_an_hour() -> None:
    spec = ticks_spec("x.ticks", Settings(kafka_replication_factor=3, kafka_min_insync_replicas=2))
    assert spec == TopicSpec("x.ticks", 3, {"min.insync.replicas": "2", "retention.ms": str(TICKS_RETENTION_MS)})
    assert ticks_spec("x.ticks", None) == TopicSpec("x.ticks", -1, {"retention.ms": str(TICKS_RETENTION_MS)})
    assert topic_spec("x.steps", Settings(), derived=False).replication_factor == 1


def test_the_workers_changelog_is_compacted_and_replicated_like_derived_topics() -> None:
    settings = Settings(kafka_replication_factor=3, kafka_min_insync_replicas=2, derived_retention_ms=1000)
    assert changelog_spec("x.changelog", settings) == TopicSpec(
        "x.changelog", 3, {"min.insync.replicas": "2", "cleanup.policy": "compact"})  # compacted: no retention
    assert changelog_spec("x.changelog", None) == TopicSpec("x.changelog", -1, {"cleanup.policy": "compact"})
    # and takes the worker's largest state record (AREAL_WORKER_STATE_RECORD_MAX_BYTES) when told
    assert changelog_spec("x.changelog", None, 8 << 20).config == {"cleanup.policy": "compact",
                                                                  "max.message.bytes": "8388608"}


def test_a_repartition_topic_is_kept_a_week_and_takes_any_input_a_reader_takes() -> None:
    from areal_metrics.streams.shell.kafka_admin import (
        KAFKA_DEFAULT_MAX_MESSAGE_BYTES,
        REPARTITION_RETENTION_MS,
        repartition_max_bytes,
        repartition_spec,
    )

    settings = Settings(kafka_replication_factor=3, kafka_min_insync_replicas=2, derived_retention_ms=-1)
    spec = repartition_spec("x-steps-repartition", settings, 9 << 20)
    assert spec == TopicSpec("x-steps-repartition", 3, {"min.insync.replicas": "2",
                                                        "retention.ms": str(REPARTITION_RETENTION_MS),
                                                        "max.message.bytes": str(9 << 20)})
    assert repartition_max_bytes(8 << 20, 1 << 20) == 8 << 20
    assert repartition_max_bytes(64 << 10, 4 << 20) == (4 << 20) + (64 << 10)  # an input a reader takes, and its key
    assert repartition_max_bytes(64 << 10, 10_000) == KAFKA_DEFAULT_MAX_MESSAGE_BYTES  # the output batches' room


class _SettlingAdmin:
    """kafka-python's admin while a new cluster's controller settles: create_topics raises `fails` times."""

    def __init__(self, fails: int) -> None:
        self.fails, self.calls = fails, 0

    def create_topics(self, new: dict, timeout_ms: int, raise_errors: bool) -> dict:
        self.calls += 1
        if self.calls <= self.fails:
            raise AssertionError("kafka-python: unexpected response while the controller moves")
        return {"topics": [{"name": n, "error_code": 0} for n in new]}


def test_topic_creation_is_tried_again_while_the_cluster_settles_then_fails_in_one_line() -> None:
    from areal_metrics.producers.contract.errors import ServiceUnavailable
    from areal_metrics.producers.runtime.topic_admin import _create

    settling = _SettlingAdmin(fails=2)
    assert _create(settling, {"t.steps": {}}, timeout=5.0)["topics"][0]["name"] == "t.steps"
    assert settling.calls == 3
    with pytest.raises(ServiceUnavailable, match=r"did not create topics t.steps within 1 s \(AssertionError: "):
        _create(_SettlingAdmin(fails=10**6), {"t.steps": {}}, timeout=1.0)


class _HostingAdmin:
    """kafka-python's admin on a cluster: topic `t` has its one partition on brokers 1 and 2, which
    host it; asking broker 2 raises `broker_2_raises` first `fails` times."""

    def __init__(self, broker_2_raises: Exception, fails: int) -> None:
        self.error, self.fails, self.asked = broker_2_raises, fails, 0

    def describe_topics(self, names: list[str]) -> list[dict]:
        return [{"name": "t", "error_code": 0,
                 "partitions": [{"partition_index": 0, "leader_id": 1, "replica_nodes": [1, 2]}]}]

    def describe_log_dirs(self, wanted: dict, brokers: list[int]) -> list[dict]:
        if brokers == [2]:
            self.asked += 1
            if self.asked <= self.fails:
                raise self.error
        return [{"broker": brokers[0], "log_dirs": [{"topics": [{"name": "t", "partitions": [{"partition_index": 0}]}]}]}]


def test_a_broker_not_reachable_yet_is_waited_for_and_one_that_refuses_to_say_is_not() -> None:
    """Under load, on a cluster just started, a broker not connected yet once counted as 'hosts the
    topics' and a client then asked that broker and found none of them (tests/test_cluster.py)."""
    from kafka.errors import ClusterAuthorizationFailedError, NodeNotReadyError, UnknownBrokerIdError

    from areal_metrics.producers.runtime.topic_admin import create_missing_topics, not_hosted

    assert not_hosted(_HostingAdmin(NodeNotReadyError(2), fails=1), ["t"]) == ["@2: NodeNotReadyError"]
    assert not_hosted(_HostingAdmin(UnknownBrokerIdError(2), fails=1), ["t"]) == ["@2: UnknownBrokerIdError"]
    assert not_hosted(_HostingAdmin(ClusterAuthorizationFailedError(), fails=1), ["t"]) == []
    waiting = _HostingAdmin(NodeNotReadyError(2), fails=3)
    waiting.list_topics = lambda: []
    waiting.create_topics = lambda new, timeout_ms, raise_errors: {"topics": [{"name": "t", "error_code": 0}]}
    assert create_missing_topics(waiting, [TopicSpec("t", 2)], 1, timeout=10) == ["t"]
    assert waiting.asked == 4  # asked again until broker 2 answered
