"""The long-running services wait for Kafka at their start instead of exiting.

A stream worker that started while its broker was unreachable exited with status 2, which its
supervisor takes for a configuration error that no restart can pass: the worker stayed down
after the broker came back. The sink exited 1 with a traceback, and its supervisor gave up after
AREAL_RESTART_MAX quick deaths in a row (a few minutes). Both now try again, on the one backoff
rule (producers/runtime/backoff.py, at most 30 s between tries), a line in their log per try,
until Kafka answers or they are stopped. Only "unreachable" is waited out: a refused login, a
topic layout that cannot work, stay one line and an exit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from areal_metrics.producers.contract.errors import ServiceUnavailable, one_line
from areal_metrics.producers.runtime.backoff import Backoff

T = TypeVar("T")
log = logging.getLogger("areal.kafka")
BACKOFF = Backoff(initial_s=1.0, factor=2.0, max_s=30.0)


def quick_bootstrap(client_config: dict[str, object]) -> dict[str, object]:
    """kafka-python settings whose bootstrap gives up within 5 s (its default waits 30): the wait
    tries again, and a stop meanwhile is seen soon."""
    return {**client_config, "bootstrap_timeout_ms": 5_000}


def unreachable_errors() -> tuple[type[BaseException], ...]:
    """What kafka-python raises while no broker answers (a bootstrap, a connection, a node not ready),
    and ServiceUnavailable (ours, e.g. topics not created within their timeout)."""
    from kafka.errors import KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError

    return KafkaConnectionError, KafkaTimeoutError, NodeNotReadyError, ServiceUnavailable


def until_kafka_answers(attempt: Callable[[], T], what: str, stop: threading.Event | None = None,
                        backoff: Backoff = BACKOFF) -> T | None:
    """`attempt()` until it returns without Kafka being unreachable; None when `stop` is set first.
    Any other error is raised at once."""
    waited = unreachable_errors()
    tries = 0
    while True:
        try:
            return attempt()
        except waited as exc:
            tries += 1
            delay = backoff.delay(tries)
            log.warning("%s: Kafka unreachable (%s); try %d again in %.0f s", what, one_line(exc)[:300], tries + 1,
                        delay)
            if stop is not None:
                if stop.wait(delay):
                    return None
            else:
                time.sleep(delay)
