"""Shared fixtures: ONE real Kafka broker (KRaft) per pytest session, and a cluster on demand.

`kafka_bootstrap` starts the broker on free loopback ports and stops it at the end;
its log is kept (and its path printed) when a test failed. `topics` gives each
test a fresh topic prefix whose topics already exist.

`kafka_cluster` is a three-node KRaft cluster (same jars), started only when a test
asks for it, once per session; `cluster_topics` creates a fresh prefix on it from
`Topics.specs(CLUSTER_DURABILITY)` (replication factor 3, min.insync.replicas 2), and
`cluster_env` is the environment of subprocesses wired to it. A test that kills a
node starts it again before it ends (`KafkaCluster.start_node`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from areal_metrics.stack.kafka_broker import KafkaBroker, create_topics
from areal_metrics.stack.kafka_cluster import KafkaCluster
from areal_metrics.stack.settings import StackSettings
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import Topics
from tests.support import service_env

# A test that names no AREAL_HOME must not use (or find the stack in) the user's ~/.areal.
os.environ.setdefault("AREAL_HOME", tempfile.mkdtemp(prefix="areal-home-"))

# The durability of topics on the test cluster: what `areal-metrics up --brokers 3` uses.
CLUSTER_DURABILITY = Settings(kafka_replication_factor=3, kafka_min_insync_replicas=2)


def _session_kafka(request: pytest.FixtureRequest, prefix: str, make, timeout: float, logs: str):
    """Start what `make(data_dir)` builds, yield it, stop it; its logs are kept when a test failed."""
    data_dir = Path(tempfile.mkdtemp(prefix=prefix))
    kafka = make(data_dir)
    kafka.start(timeout=timeout)
    yield kafka
    kafka.stop()
    if request.session.testsfailed:
        print(f"\nKafka logs kept at {data_dir / logs}")
    else:
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def kafka_broker(request: pytest.FixtureRequest):
    # a SASL/PLAIN listener beside the plain one, for the security-settings tests
    yield from _session_kafka(request, "areal-test-kafka-",
                              lambda d: KafkaBroker(d, sasl_users={"areal": "areal-secret"}, stack=StackSettings.from_env()),
                              120, "broker.log")


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_broker: KafkaBroker) -> str:
    return kafka_broker.bootstrap


@pytest.fixture
def topics(kafka_bootstrap: str) -> Topics:
    t = Topics(f"t{uuid.uuid4().hex[:10]}.")
    create_topics(kafka_bootstrap, t.all(), partitions=3)
    return t


@pytest.fixture
def stack_env(kafka_bootstrap: str, topics: Topics, tmp_path: Path) -> dict[str, str]:
    """Environment for subprocesses (worker, sink, trainer) wired to the test broker."""
    return service_env(kafka_bootstrap, topics.prefix, tmp_path)


@pytest.fixture(scope="session")
def kafka_cluster(request: pytest.FixtureRequest):
    yield from _session_kafka(request, "areal-test-kafka-cluster-",
                              lambda d: KafkaCluster(d, size=3, stack=StackSettings.from_env()), 180,
                              "node-*/broker.log")


@pytest.fixture
def cluster_topics(kafka_cluster: KafkaCluster) -> Topics:
    t = Topics(f"c{uuid.uuid4().hex[:10]}.")
    create_topics(kafka_cluster.bootstrap, t.specs(CLUSTER_DURABILITY), partitions=3)
    return t


@pytest.fixture
def cluster_env(kafka_cluster: KafkaCluster, cluster_topics: Topics, tmp_path: Path) -> dict[str, str]:
    """Environment for subprocesses wired to the test cluster, with its durability settings."""
    return service_env(kafka_cluster.bootstrap, cluster_topics.prefix, tmp_path,
                       AREAL_KAFKA_REPLICATION_FACTOR=str(CLUSTER_DURABILITY.kafka_replication_factor),
                       AREAL_KAFKA_MIN_INSYNC_REPLICAS=str(CLUSTER_DURABILITY.kafka_min_insync_replicas))
