"""The three-broker KRaft cluster: topics made from their specs, and `areal-metrics up --brokers 3`."""

from __future__ import annotations

import json
import os
import signal
import uuid

import pytest
from kafka import KafkaAdminClient
from kafka.admin import ConfigResource, ConfigResourceType

from areal_metrics.stack.kafka_broker import create_topics
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.runtime.topic_admin import TopicCreationError
from areal_metrics.producers.contract.topics import Topics
from tests.test_cli_stack import status_until
from tests import support

pytestmark = [pytest.mark.broker, pytest.mark.timeout(420)]


def cli(*args: str, env: dict[str, str]):
    return support.cli(*args, env=env, timeout=300)  # a three-broker cluster starts slowly


def describe(bootstrap: str, names: list[str]) -> dict[str, tuple[set[int], dict[str, str]]]:
    """{topic: ({replica count of each partition}, {config: value} as the broker reports them)}."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","))
    try:
        replicas = {d["name"]: {len(p["replica_nodes"]) for p in d["partitions"]} for d in admin.describe_topics(names)}
        assert all(replicas.values()), replicas  # every broker knows the topics the creator waited for
        wanted = {"min.insync.replicas": None, "retention.ms": None, "retention.bytes": None}
        result = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n, configs=dict(wanted))
                                         for n in names], config_filter="all")
    finally:
        admin.close()
    configs = {name: {key: entry["value"] if isinstance(entry, dict) else entry for key, entry in cfg.items()}
               for name, cfg in result["topic"].items()}
    return {n: (replicas[n], configs[n]) for n in names}


def test_topics_from_specs_have_three_replicas_min_isr_two_and_their_retention(kafka_cluster):
    settings = Settings(kafka_replication_factor=3, kafka_min_insync_replicas=2, derived_retention_ms=86_400_000)
    topics = Topics(f"c{uuid.uuid4().hex[:10]}.")
    create_topics(kafka_cluster.bootstrap, topics.specs(settings), partitions=3)
    got = describe(kafka_cluster.bootstrap, topics.all())
    for name, (replicas, config) in got.items():
        assert replicas == {3}, name
        assert config["min.insync.replicas"] == "2", name
        expected_retention = "86400000" if topics.is_derived(name) else "-1"  # raw topics kept forever
        assert config["retention.ms"] == expected_retention, name
    assert got[topics.consensus][1]["retention.ms"] == "86400000" and got[topics.steps][1]["retention.bytes"] == "-1"


def test_every_broker_answers_for_a_topic_as_soon_as_its_creation_returns(kafka_cluster):
    """Without waiting for every replica (producers/runtime/topic_admin.py), a client asking another
    broker right after creation missed new topics in about 1 creation of 4 here."""
    settings = Settings(kafka_replication_factor=3, kafka_min_insync_replicas=2)
    for _ in range(6):
        topics = Topics(f"c{uuid.uuid4().hex[:10]}.")
        create_topics(kafka_cluster.bootstrap, topics.specs(settings), partitions=3)
        for node in kafka_cluster.nodes:  # a fresh client, whichever broker it asks
            admin = KafkaAdminClient(bootstrap_servers=[node.bootstrap])
            try:
                missing = [d["name"] for d in admin.describe_topics(topics.all())
                           if d.get("error_code") or not d.get("partitions")]
            finally:
                admin.close()
            assert missing == [], missing


def test_a_replication_factor_above_the_broker_count_is_refused_naming_the_topic(kafka_bootstrap):
    topics = Topics(f"t{uuid.uuid4().hex[:10]}.")
    settings = Settings(kafka_replication_factor=3, kafka_min_insync_replicas=2)
    with pytest.raises(TopicCreationError, match=rf"topic {topics.prefix}\S+: .*replication factor"):
        create_topics(kafka_bootstrap, topics.specs(settings), partitions=3, timeout=15)


def test_up_with_three_brokers_status_shows_each_a_killed_one_and_up_restarts_it(tmp_path):
    env = {**os.environ, "AREAL_HOME": str(tmp_path), "AREAL_TOPIC_PREFIX": "stk3."}
    for name in ("AREAL_KAFKA_BOOTSTRAP", "AREAL_KAFKA_REPLICATION_FACTOR", "AREAL_KAFKA_MIN_INSYNC_REPLICAS"):
        env.pop(name, None)
    try:
        first = cli("up", "--brokers", "3", "--no-worker", "--no-sink", env=env)
        assert first.returncode == 0, first.stderr
        status = json.loads(cli("status", "--json", env=env).stdout)
        assert status["running"] and status["brokers"] == 3
        brokers = {name: p for name, p in status["processes"].items() if name.startswith("kafka")}
        assert sorted(brokers) == ["kafka-1", "kafka-2", "kafka-3"]
        assert ",".join(p["address"] for p in brokers.values()) == status["kafka_bootstrap"]
        got = describe(status["kafka_bootstrap"], Topics("stk3.").all())
        assert all(replicas == {3} and config["min.insync.replicas"] == "2" for replicas, config in got.values())

        os.kill(brokers["kafka-2"]["pid"], signal.SIGKILL)
        down_one = status_until(env, lambda r: "DOWN" in r.stdout)
        assert down_one.returncode == 1
        assert f"kafka-2 pid {brokers['kafka-2']['pid']} DOWN at {brokers['kafka-2']['address']}" in down_one.stdout
        assert f"kafka-1 pid {brokers['kafka-1']['pid']} up" in down_one.stdout

        other_count = cli("up", "--brokers", "1", env=env)  # the cluster's log is the source of truth
        assert other_count.returncode == 2 and len(other_count.stderr.strip().splitlines()) == 1
        assert "made with 3 broker(s)" in other_count.stderr

        again = cli("up", "--no-worker", "--no-sink", env=env)  # no --brokers: as the stack was made
        assert again.returncode == 0 and "started" in again.stdout, again.stderr
        restarted = json.loads(cli("status", "--json", env=env).stdout)
        assert restarted["running"] and restarted["kafka_bootstrap"] == status["kafka_bootstrap"]  # same ports
    finally:
        down = cli("down", env=env)
    assert down.returncode == 0 and all(f"kafka-{i}" in down.stdout for i in (1, 2, 3)), down.stdout
    assert cli("status", env=env).returncode == 1
