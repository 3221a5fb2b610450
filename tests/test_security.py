"""Security settings against the real broker's SASL/PLAIN listener.

The session broker has a SASL_PLAINTEXT listener beside the plain one (user
`areal`). The clients take their credentials from the environment (the
password from a file), deliver through it, and never print the password; a
wrong password loses nothing (the publisher journals) and never raises into
the caller.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
from kafka import KafkaConsumer

from areal_metrics.producers.contract.events import StepEvent, parse_event
from areal_metrics.producers.delivery.publisher import Publisher
from areal_metrics.producers.contract.settings import Settings

pytestmark = pytest.mark.broker

SECRET = "areal-secret"


@pytest.fixture
def sasl_env(kafka_broker, topics, tmp_path, monkeypatch):
    secret_file = tmp_path / "kafka-password"
    secret_file.write_text(SECRET + "\n")
    env = {
        "AREAL_KAFKA_BOOTSTRAP": kafka_broker.sasl_bootstrap,
        "AREAL_TOPIC_PREFIX": topics.prefix,
        "AREAL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "AREAL_KAFKA_SASL_MECHANISM": "PLAIN",
        "AREAL_KAFKA_SASL_USERNAME": "areal",
        "AREAL_KAFKA_SASL_PASSWORD_FILE": str(secret_file),
        "AREAL_HOME": str(tmp_path / "home"),
    }
    monkeypatch.delenv("AREAL_KAFKA_SASL_PASSWORD", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def read(settings: Settings, topic: str, expect: int, timeout: float = 30.0) -> list:
    consumer = KafkaConsumer(topic, **settings.kafka_python_config(), auto_offset_reset="earliest",
                             enable_auto_commit=False, group_id=None)
    out: list = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < expect and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                out += [parse_event(r.value) for r in records]
    finally:
        consumer.close()
    return out


def test_publisher_and_consumer_authenticate_with_settings_from_the_environment(sasl_env, topics, tmp_path, caplog):
    settings = Settings.from_env()
    assert settings.kafka_sasl_password == SECRET  # read from the _FILE
    assert SECRET not in repr(settings) and SECRET not in str(settings.public())
    caplog.set_level(logging.DEBUG)
    publisher = Publisher.from_settings(settings, journal_dir=tmp_path / "journal")
    events = [StepEvent(run_id="secure", step=i, epoch=0, reward=0.5) for i in range(5)]
    for e in events:
        publisher.publish(e)
    assert publisher.flush(30), publisher.stats()
    publisher.close()
    assert [e.event_id for e in read(settings, topics.steps, 5)] == [e.event_id for e in events]
    assert SECRET not in caplog.text  # kafka-python's and our logs never carry the secret


def test_a_wrong_password_loses_nothing_and_never_raises(sasl_env, topics, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AREAL_KAFKA_SASL_PASSWORD", "wrong-password")  # the variable wins over the file
    caplog.set_level(logging.DEBUG)
    publisher = Publisher.from_settings(Settings.from_env(), journal_dir=tmp_path / "journal")
    publisher.publish(StepEvent(run_id="secure", step=0, epoch=0))
    assert not publisher.flush(3)
    publisher.close(timeout=1)
    assert publisher.journal is not None and publisher.stats().spilled == 1
    assert "wrong-password" not in caplog.text

    monkeypatch.delenv("AREAL_KAFKA_SASL_PASSWORD")  # fixed: the journal is delivered
    again = Publisher.from_settings(Settings.from_env(), journal_dir=tmp_path / "journal")
    assert again.flush(30)
    again.close()
    assert len(read(Settings.from_env(), topics.steps, 1)) == 1


def test_stream_worker_runs_over_sasl(sasl_env, topics, tmp_path):
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, "-m", "areal_metrics.streams"], env={**os.environ, **sasl_env},
                              stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        settings = Settings.from_env()
        publisher = Publisher.from_settings(settings, journal_dir=tmp_path / "journal")
        publisher.publish(StepEvent(run_id="secure", step=0, epoch=0, reward=0.25))
        assert publisher.flush(30)
        publisher.close()
        smoothed = read(settings, topics.smoothed, 1, timeout=90)
        assert [(s.run_id, s.step, s.reward) for s in smoothed] == [("secure", 0, 0.25)], log.read_text()[-2000:]
        assert SECRET not in log.read_text()
    finally:
        worker.terminate()
        worker.wait(30)
