"""producers/runtime/kafka_wait.py without a broker: what is waited out, what is raised, no client
made while nothing listens, and no thread left behind by a client whose first contact failed."""

from __future__ import annotations

import logging
import socket
import threading

import pytest
from kafka.errors import KafkaTimeoutError, TopicAuthorizationFailedError

from areal_metrics.producers.contract.errors import ServiceUnavailable
from areal_metrics.producers.runtime.backoff import Backoff
from areal_metrics.producers.runtime.kafka_wait import closed_on_failure, until_kafka_answers
from areal_metrics.stack.kafka_broker import free_port

NO_WAIT = Backoff(initial_s=0.0, factor=1.0, max_s=0.0)


@pytest.fixture
def listening() -> str:
    """A loopback port that accepts TCP connections (what the check before each try asks for)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


def failing(errors: list[BaseException], value: str = "ready"):
    calls = []

    def attempt() -> str:
        calls.append(1)
        if errors:
            raise errors.pop(0)
        return value
    return attempt, calls


def test_what_is_not_ready_is_waited_out_and_the_rest_is_raised(listening: str) -> None:
    attempt, calls = failing([KafkaTimeoutError("Unable to bootstrap"), TimeoutError("topics did not appear"),
                              ServiceUnavailable("topics not created")])
    assert until_kafka_answers(attempt, "test", [listening], backoff=NO_WAIT) == "ready" and len(calls) == 4
    refused, calls = failing([TopicAuthorizationFailedError("no")])
    with pytest.raises(TopicAuthorizationFailedError):
        until_kafka_answers(refused, "test", [listening], backoff=NO_WAIT)
    assert len(calls) == 1


def test_no_client_is_made_while_nothing_listens_and_a_stop_ends_the_wait(caplog: pytest.LogCaptureFixture) -> None:
    attempt, calls = failing([])
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with caplog.at_level(logging.WARNING, logger="areal.kafka"):
        assert until_kafka_answers(attempt, "test", [f"127.0.0.1:{free_port()}"], stop, Backoff(0.05, 1.0, 0.05)) is None
    assert calls == [] and "no broker accepts a connection at 127.0.0.1:" in caplog.text


def test_a_client_whose_first_contact_fails_leaves_no_thread_behind(listening: str) -> None:
    from kafka import KafkaAdminClient, KafkaConsumer

    # `listening` accepts and never speaks Kafka: each constructor's bootstrap gives up after 200 ms
    before = threading.active_count()
    for cls in (KafkaConsumer, KafkaAdminClient) * 3:
        with pytest.raises(KafkaTimeoutError):
            closed_on_failure(cls, bootstrap_servers=[listening], bootstrap_timeout_ms=200)
    assert threading.active_count() == before


def test_the_control_feed_gathers_no_threads_while_its_broker_does_not_answer(listening: str,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer's control feed tries again and again while the broker is away: each failed try used to
    leave a kafka-python I/O thread behind in the training process."""
    import time

    from areal_metrics.producers.client import control_feed

    monkeypatch.setattr(control_feed, "RETRY", Backoff(initial_s=0.05, factor=1.0, max_s=0.05))
    before = threading.active_count()
    feed = control_feed.ControlFeed({"bootstrap_servers": [listening], "bootstrap_timeout_ms": 200}, "t.control",
                                    "run", "node:0", since=0.0)
    try:
        time.sleep(2.5)  # about ten tries
        during = threading.active_count()
    finally:
        feed.close(5)
    assert during <= before + 2, during - before  # the feed's thread, and a try's own while it runs
