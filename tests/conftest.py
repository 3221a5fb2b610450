"""Shared fixtures: ONE real Kafka broker (KRaft) per pytest session.

`kafka_bootstrap` starts it on free loopback ports and stops it at the end;
its log is kept (and its path printed) when a test failed. `topics` gives each
test a fresh topic prefix whose seven topics already exist.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from areal_metrics.stack.kafka_broker import KafkaBroker, create_topics
from producers.topics import Topics


@pytest.fixture(scope="session")
def kafka_broker(request: pytest.FixtureRequest):
    data_dir = Path(tempfile.mkdtemp(prefix="areal-test-kafka-"))
    # a SASL/PLAIN listener beside the plain one, for the security-settings tests
    broker = KafkaBroker(data_dir, sasl_users={"areal": "areal-secret"})
    broker.start(timeout=120)
    yield broker
    broker.stop()
    if request.session.testsfailed:
        print(f"\nKafka broker log kept at {broker.log_file}")
    else:
        shutil.rmtree(data_dir, ignore_errors=True)


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
    env = dict(os.environ)
    env.update(
        AREAL_KAFKA_BOOTSTRAP=kafka_bootstrap,
        AREAL_TOPIC_PREFIX=topics.prefix,
        AREAL_HOME=str(tmp_path / "areal"),
        AREAL_CLICKHOUSE_URL=f"chdb://{tmp_path / 'clickhouse'}",
        PYTHONUNBUFFERED="1",
    )
    return env
