"""The non-blocking publisher against the real broker."""

import importlib.util
import json
import threading
import time

import pytest

from areal_metrics.stack.kafka_broker import free_port
from areal_metrics.producers.contract.events import StepEvent, parse_event
from areal_metrics.producers.delivery.journal import open_journal
from areal_metrics.producers.delivery.publisher import Publisher
from tests.kafka_reading import read_to_end
from tests.test_events import one_of_each

pytestmark = pytest.mark.broker

# every test runs with each Kafka client the publisher can deliver through (areal_metrics.producers.delivery.backends)
CLIENTS = ["kafka-python"] + (["confluent-kafka"] if importlib.util.find_spec("confluent_kafka") else [])


@pytest.fixture(params=CLIENTS)
def client(request):
    return request.param


def test_every_event_type_round_trips_field_by_field(kafka_bootstrap, topics, tmp_path, client):
    publisher = Publisher(kafka_bootstrap, topics, tmp_path / "journal", kafka_client=client)
    events = one_of_each()
    for event in events:
        publisher.publish(event)
    assert publisher.flush(30)
    assert publisher.kafka_client == client
    publisher.close()
    messages = read_to_end(kafka_bootstrap, *topics.all())
    by_id = {parse_event(m.value).event_id: m for m in messages}
    assert len(by_id) == len(events)
    for event in events:
        message = by_id[event.event_id]
        assert message.topic == topics.for_event(event)
        assert message.key == event.run_id.encode()
        assert parse_event(message.value) == event
        assert json.loads(message.value) == event.to_dict()
    stats = publisher.stats()
    assert (stats.queued, stats.sent, stats.spilled, stats.pending) == (len(events), len(events), 0, 0)


def test_unreachable_broker_spills_to_journal_and_a_later_publisher_sends_it(kafka_bootstrap, topics, tmp_path,
                                                                            client):
    dead = f"127.0.0.1:{free_port()}"
    publisher = Publisher(dead, topics, tmp_path / "journal", kafka_client=client)
    events = [StepEvent(run_id="r-dead", step=i, epoch=0, reward=float(i)) for i in range(200)]
    started = time.perf_counter()
    for event in events:
        publisher.publish(event)
    assert time.perf_counter() - started < 1.0  # publish never waits for the broker
    assert not publisher.flush(2)
    publisher.close(timeout=1)
    assert publisher.stats().spilled == 200

    again = Publisher(kafka_bootstrap, topics, tmp_path / "journal", kafka_client=client)  # same journal, live broker
    assert again.flush(30)
    again.close()
    assert again.stats().resent == 200
    got = [parse_event(m.value) for m in read_to_end(kafka_bootstrap, topics.steps)]
    assert [e.event_id for e in got] == [e.event_id for e in events]


def test_broker_down_while_publishing_loses_nothing_and_keeps_order(kafka_broker, topics, tmp_path, client):
    """Stop the real broker mid-stream, keep publishing, restart it: every event arrives, once per id, in order."""
    publisher = Publisher(kafka_broker.bootstrap, topics, tmp_path / "journal", stall_s=0.5, kafka_client=client)
    runs = ["run-a", "run-b", "run-c"]
    sent: list[StepEvent] = []
    worst_publish = 0.0

    def publish_some(n):
        nonlocal worst_publish
        for _ in range(n):
            run = runs[len(sent) % 3]
            event = StepEvent(run_id=run, step=len(sent), epoch=0, reward=0.5)
            t = time.perf_counter()
            publisher.publish(event)
            worst_publish = max(worst_publish, time.perf_counter() - t)
            sent.append(event)

    publish_some(300)
    assert publisher.flush(30)
    kafka_broker.stop()
    for _ in range(20):  # 2 s of training while the broker is away
        publish_some(50)
        time.sleep(0.1)
    kafka_broker.start(timeout=120)
    publish_some(300)
    assert publisher.flush(90), publisher.stats()
    assert publisher.kafka_client == client
    publisher.close()
    stats = publisher.stats()
    assert stats.spilled > 0 and stats.resent > 0
    # the caller never waited on the broker (a connect or metadata wait takes seconds; the
    # bound leaves room for a scheduling pause on a loaded 2-core machine)
    assert worst_publish < 1.0

    got = [parse_event(m.value) for m in read_to_end(kafka_broker.bootstrap, topics.steps)]
    ids = [e.event_id for e in got]
    assert set(ids) == {e.event_id for e in sent}  # nothing lost
    first_seen: dict[str, list[int]] = {r: [] for r in runs}
    seen = set()
    for e in got:
        if e.event_id not in seen:
            seen.add(e.event_id)
            first_seen[e.run_id].append(e.step)
    for run in runs:
        assert first_seen[run] == sorted(first_seen[run])  # in order per run
    # re-sends keep their event_id; a duplicate delivery is at most the single probe record
    assert len(ids) - len(set(ids)) <= 1


class SlowRecord:
    """An `Outgoing` whose encoding takes a while: it widens the moment the sender holds it."""

    def __init__(self, run_id: str, seconds: float = 0.5):
        self.run_id, self.seconds = run_id, seconds

    def encode(self, topics):
        time.sleep(self.seconds)
        return topics.steps, self.run_id.encode(), StepEvent(run_id=self.run_id, step=0, epoch=0, reward=0.5).to_json()


def test_flush_is_not_fooled_while_the_sender_journals_a_record(topics, tmp_path):
    """An unreachable broker: the record is being moved to the journal, never acknowledged, so flush says False.

    (It once said True while the sender had the record in hand, between queue and
    journal: `publish` then printed "published" to a broker nowhere.)"""
    publisher = Publisher(f"127.0.0.1:{free_port()}", topics, tmp_path / "journal")
    publisher.publish(SlowRecord("r-slow"))
    assert not publisher.flush(1.0)
    assert publisher.flush(5.0, journaled_ok=True)
    publisher.close(timeout=1)
    assert publisher.stats().spilled == 1 and publisher.journal.has_pending()


def test_a_record_enqueued_as_close_began_is_journaled_not_dropped(topics, tmp_path, monkeypatch):
    """publish() checked that the publisher was open, then close() ran the sender's last drain, then the append."""
    late = StepEvent(run_id="r-late", step=0, epoch=0)
    shutdown = Publisher._shutdown

    def shutdown_then_a_late_append(self):
        shutdown(self)
        self._core.queue.append(late)

    monkeypatch.setattr(Publisher, "_shutdown", shutdown_then_a_late_append)
    publisher = Publisher(f"127.0.0.1:{free_port()}", topics, tmp_path / "journal")
    publisher.close(timeout=0.2)
    reopened = open_journal(tmp_path / "journal")
    try:
        assert [parse_event(r.value).event_id for r in reopened.read(10)] == [late.event_id]
    finally:
        reopened.close()


def test_two_closes_at_once_both_return(topics, tmp_path):
    publisher = Publisher(f"127.0.0.1:{free_port()}", topics, tmp_path / "journal")
    publisher.publish(StepEvent(run_id="r-two", step=0, epoch=0))
    errors = []

    def close():
        try:
            publisher.close(timeout=0.5)
        except Exception as exc:  # noqa: BLE001 - the assertion below names it
            errors.append(exc)

    closers = [threading.Thread(target=close) for _ in range(2)]
    for t in closers:
        t.start()
    for t in closers:
        t.join(30)
    assert errors == [] and publisher.stats().spilled == 1


def test_flush_waits_for_the_acknowledgement_of_a_record_being_encoded(kafka_bootstrap, topics, tmp_path, client):
    publisher = Publisher(kafka_bootstrap, topics, tmp_path / "journal", kafka_client=client)
    publisher.publish(StepEvent(run_id="r-first", step=0, epoch=0, reward=0.5))
    assert publisher.flush(30)  # connected: the next record goes straight into the client
    publisher.publish(SlowRecord("r-slow"))
    assert publisher.flush(30)
    assert publisher.stats().sent == 2
    publisher.close()


@pytest.mark.skipif(len(CLIENTS) < 2, reason="confluent-kafka is not installed")
def test_both_clients_put_a_run_on_the_same_partition(kafka_bootstrap, topics, tmp_path):
    """Order per run survives a change of client: the same key lands on the same partition (murmur2)."""
    runs = [f"run-{i}" for i in range(12)]
    for client in CLIENTS:
        publisher = Publisher(kafka_bootstrap, topics, tmp_path / client, kafka_client=client)
        for run in runs:
            publisher.publish(StepEvent(run_id=run, step=0, epoch=0, reward=0.5))
        assert publisher.flush(30)
        publisher.close()
    partitions: dict[str, set[int]] = {}
    for m in read_to_end(kafka_bootstrap, topics.steps):
        partitions.setdefault(m.key.decode(), set()).add(m.partition)
    assert sorted(partitions) == sorted(runs)
    assert all(len(p) == 1 for p in partitions.values()), partitions
    assert len(set().union(*partitions.values())) > 1  # the keys do spread over the 3 partitions


def test_auto_falls_back_to_kafka_python_for_a_setting_librdkafka_cannot_spell(kafka_bootstrap, topics, tmp_path):
    publisher = Publisher(kafka_bootstrap, topics, tmp_path / "journal", kafka_config={"max_request_size": 2_000_000})
    publisher.publish(StepEvent(run_id="r-fallback", step=0, epoch=0, reward=0.5))
    assert publisher.flush(30)
    assert publisher.kafka_client == "kafka-python"
    publisher.close()
    assert [m.key for m in read_to_end(kafka_bootstrap, topics.steps)] == [b"r-fallback"]


def test_auto_picks_confluent_kafka_when_installed(kafka_bootstrap, topics, tmp_path):
    publisher = Publisher(kafka_bootstrap, topics, tmp_path / "journal")
    publisher.publish(StepEvent(run_id="r-auto", step=0, epoch=0, reward=0.5))
    assert publisher.flush(30)
    assert publisher.kafka_client == CLIENTS[-1]
    publisher.close()


def test_an_unknown_client_name_is_refused_at_once(tmp_path):
    with pytest.raises(ValueError, match="kafka_client 'rdkafka'"):
        Publisher("127.0.0.1:1", None, tmp_path / "journal", kafka_client="rdkafka")


def test_every_connection_setting_has_its_librdkafka_spelling():
    from areal_metrics.producers.delivery.backends import librdkafka_config
    from areal_metrics.producers.contract.settings import Settings

    settings = Settings(kafka_bootstrap="a:1,b:2", kafka_security_protocol="SASL_SSL", kafka_sasl_mechanism="PLAIN",
                        kafka_sasl_username="u", kafka_sasl_password="p", kafka_ssl_cafile="/ca.pem",
                        kafka_ssl_certfile="/cert.pem", kafka_ssl_keyfile="/key.pem")
    assert librdkafka_config(settings.kafka_python_config()) == {
        "bootstrap.servers": "a:1,b:2", "security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN",
        "sasl.username": "u", "sasl.password": "p", "ssl.ca.location": "/ca.pem",
        "ssl.certificate.location": "/cert.pem", "ssl.key.location": "/key.pem"}
    assert librdkafka_config({"bootstrap_servers": ["a:1"], "max_request_size": 1}) is None  # -> kafka-python


def test_a_message_larger_than_a_record_goes_as_a_dead_letter_and_holds_nothing_back(kafka_bootstrap, topics, tmp_path,
                                                                                     client):
    """A message over a record's bytes is refused by the producer at every try: journaled (by a client before
    the size check), it held back every record behind it for good. Now it goes as a dead letter naming its
    size, from the queue as from the journal, and the records after it are delivered in order."""
    from areal_metrics.producers.contract.events import RejectedEvent

    big = StepEvent(run_id="r-big", step=0, epoch=0, metrics={f"m{i}": 1.0 for i in range(10)}).to_json()
    big = big[:-1] + b',"pad":"' + b"x" * (1 << 20) + b'"}'  # over 1 MiB
    small = [StepEvent(run_id="r-big", step=i, epoch=0, reward=float(i)) for i in range(1, 6)]
    journal = open_journal(tmp_path / "journal")
    journal.append(topics.steps, b"r-big", big)
    for event in small[:2]:
        journal.append(topics.steps, b"r-big", event.to_json())
    journal.close()

    class Raw:  # an Outgoing that encodes to the oversized message
        def encode(self, _topics):
            return topics.steps, b"r-big", big

    publisher = Publisher(kafka_bootstrap, topics, tmp_path / "journal", kafka_client=client)
    publisher.publish(Raw())
    for event in small[2:]:
        publisher.publish(event)
    assert publisher.flush(30)
    publisher.close()
    steps = [parse_event(m.value) for m in read_to_end(kafka_bootstrap, topics.steps)]
    assert [e.step for e in steps] == [1, 2, 3, 4, 5]  # in order, none held back
    letters = [parse_event(m.value) for m in read_to_end(kafka_bootstrap, topics.deadletter)]
    assert len(letters) == 2 and all(isinstance(e, RejectedEvent) and e.run_id == "r-big" for e in letters)
    assert all("larger than a record may be" in e.reason and e.source_topic == topics.steps for e in letters)
    assert not open_journal(tmp_path / "journal").has_pending()


def test_the_dead_letter_of_a_message_too_large_fits_a_record(topics, tmp_path):
    """Its raw text keeps the message's first bytes, not characters: 4-byte characters kept by the character
    made a letter over 1 MiB, refused in turn (a review)."""
    from areal_metrics.producers.delivery.publisher import RECORD_OVERHEAD_BYTES, SEND_MAX_BYTES

    publisher = Publisher(f"127.0.0.1:{free_port()}", topics, tmp_path / "journal")
    try:
        for text in ("\U0001F600" * 300_000, "x" * 1_200_000, "\u00e9" * 600_000):
            value = json.dumps({"type": "run", "run_id": "r", "notes": text}, ensure_ascii=False).encode()
            topic, key, letter = publisher._sendable((topics.runs, b"r", value))
            assert topic == topics.deadletter and len(key) + len(letter) + RECORD_OVERHEAD_BYTES <= SEND_MAX_BYTES
            assert parse_event(letter).type == "rejected"
    finally:
        publisher.close(timeout=0.5)
