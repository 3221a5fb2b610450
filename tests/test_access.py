"""The least-privilege table (areal_metrics.stack.access), without a broker: the page shows it,
it names the groups and topics the services use, and SCRAM is a setting every client reads.
tests/test_secured_broker.py runs the pipeline under these ACLs on a real secured broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.events import (
    AlertEvent,
    CommandEvent,
    EvalConsensusEvent,
    RejectedEvent,
    RewardSmoothedEvent,
)
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.stack import access

ROOT = Path(__file__).resolve().parents[1]


def table(prefix: str = "areal.") -> dict[str, access.Component]:
    return access.components(Topics(prefix), worker=access.worker_group(prefix), sink=access.sink_group(prefix))


def allowed(c: access.Component, resource: str, op: str) -> set[str]:
    return {g.name for g in c.kafka if g.resource == resource and op in g.operations and not g.prefixed}


def test_docs_security_shows_the_table_the_code_applies() -> None:
    page = (ROOT / "docs" / "SECURITY.md").read_text()
    assert access.markdown(access.documented_table()) in page, \
        "run `python -m areal_metrics.stack.access` into docs/SECURITY.md"


def test_the_trainer_cannot_write_commands_nor_read_alerts() -> None:
    t, trainer = Topics(), table()["trainer"]
    assert t.control not in allowed(trainer, access.TOPIC, access.WRITE)
    assert t.alerts not in allowed(trainer, access.TOPIC, access.READ)
    assert t.control in allowed(trainer, access.TOPIC, access.READ)  # run.commands()
    assert not [g for g in trainer.kafka if g.resource == access.GROUP or g.prefixed or access.CREATE in g.operations]


def test_the_worker_may_write_every_output_and_its_own_topics_only() -> None:
    from areal_metrics.streams.shell.app import ticks_topic_for

    t, worker = Topics("x."), table("x.")["worker"]
    outputs = {t.for_event(e) for e in (RewardSmoothedEvent, EvalConsensusEvent, CommandEvent, AlertEvent, RejectedEvent)}
    assert allowed(worker, access.TOPIC, access.WRITE) == outputs
    assert allowed(worker, access.TOPIC, access.READ) == {t.steps, t.evals, t.runs, t.acks}  # streams/shell/app.py: its four inputs
    [own] = [g for g in worker.kafka if g.prefixed]
    # its ticks, its table's changelog (streams/__main__.py's name) and Faust's assignor topic
    for name in (ticks_topic_for(t.prefix), f"{access.worker_group(t.prefix)}-runs-changelog"):
        assert name.startswith(own.name)
    assert not access.worker_group("x2.").startswith(own.name)  # another prefix's worker is not covered
    assert allowed(worker, access.GROUP, access.READ) == {access.worker_group("x.")}


def test_the_sink_reads_every_topic_in_its_group_and_writes_dead_letters() -> None:
    from areal_metrics.sinks.sink import Sink

    t, sink = Topics("x."), table("x.")["sink"]
    assert allowed(sink, access.TOPIC, access.READ) == set(t.all())
    assert allowed(sink, access.TOPIC, access.WRITE) == {t.alerts, t.deadletter}  # alerts: poison_message
    group = Sink(Settings(topic_prefix="x.", clickhouse_url="chdb:///tmp/unused")).group
    assert allowed(sink, access.GROUP, access.READ) == {group}
    assert any("INSERT" in g for g in sink.clickhouse)
    assert all(g.startswith("GRANT SELECT") for g in table()["reader"].clickhouse)


def test_kafka_acls_are_one_per_operation_with_the_pattern_type() -> None:
    from kafka.admin import ACLOperation, ACLResourcePatternType, ResourceType

    acls = access.kafka_acls("User:w", table("x.")["worker"].kafka)
    own = [a for a in acls if a.resource_pattern.pattern_type == ACLResourcePatternType.PREFIXED]
    assert {a.operation for a in own} == {ACLOperation.READ, ACLOperation.WRITE, ACLOperation.CREATE,
                                          ACLOperation.DESCRIBE_CONFIGS}
    assert {a.resource_pattern.resource_type for a in acls} == {ResourceType.TOPIC, ResourceType.GROUP}
    assert {a.principal for a in acls} == {"User:w"}


@pytest.mark.parametrize("given, kafka", [("SCRAM-SHA-256", "SCRAM-SHA-256"), ("scram-sha-512", "SCRAM-SHA-512"),
                                          ("plain", "PLAIN")])
def test_the_sasl_mechanism_reaches_every_client_in_kafkas_spelling(given: str, kafka: str) -> None:
    from areal_metrics.producers.delivery.backends import librdkafka_config
    from areal_metrics.streams.shell.app import broker_credentials

    settings = Settings.from_env({"AREAL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "AREAL_KAFKA_SASL_MECHANISM": given,
                                  "AREAL_KAFKA_SASL_USERNAME": "u", "AREAL_KAFKA_SASL_PASSWORD": "p",
                                  "AREAL_HOME": "/tmp/areal-access-test"})
    config = settings.kafka_python_config()
    assert config["sasl_mechanism"] == kafka  # kafka-python (client, sink, alerts, replay)
    assert (librdkafka_config(config) or {})["sasl.mechanism"] == kafka  # confluent-kafka (client)
    assert broker_credentials(settings).mechanism.value == kafka  # Faust/aiokafka (worker)


def test_an_unknown_sasl_mechanism_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="AREAL_KAFKA_SASL_MECHANISM"):
        Settings.from_env({"AREAL_KAFKA_SASL_MECHANISM": "SCRAM-SHA256", "AREAL_HOME": "/tmp/areal-access-test"})
