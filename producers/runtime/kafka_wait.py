"""The long-running services wait for Kafka at their start instead of exiting, and the helpers for it.

A stream worker that started while its broker was unreachable exited with status 2, which its
supervisor takes for a configuration error that no restart can pass: the worker stayed down
after the broker came back. The sink exited 1 with a traceback, and its supervisor gave up after
AREAL_RESTART_MAX quick deaths in a row (a few minutes). Both now try again, on the one backoff
rule (producers/runtime/backoff.py: 1 s, doubled, at most 30 s between tries), a line in their
log per try, until Kafka answers or they are stopped.

- `bootstrap_reachable`: a TCP connection to a bootstrap server, before any Kafka client is
  built (the publisher checks it too): while no broker accepts one, no client is made at all.
- `closed_on_failure`: kafka-python 3's consumer and admin client start their I/O thread before
  their first contact with the broker and leave it running when that contact fails; made
  through this, a client whose constructor raises is closed (a thread and its sockets per try
  otherwise: a service waiting an hour would hold a hundred).
- What is waited out: kafka-python's retriable errors (no answer in time, a connection lost, a
  node not ready, a leader not there yet), Python's TimeoutError (topics not ready in time) and
  our ServiceUnavailable. A broker that accepts connections and never lets the client in (a
  refused SASL login, a TLS handshake) reads in kafka-python as a bootstrap that timed out, like
  a broker still starting: it is waited out too, and the log line says both causes.
  A non-retriable error once Kafka answered (an authorization refused, a topic layout that
  cannot work) is raised at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from areal_metrics.producers.contract.errors import ServiceUnavailable, one_line
from areal_metrics.producers.runtime.backoff import Backoff

T = TypeVar("T")
log = logging.getLogger("areal.kafka")
BACKOFF = Backoff(initial_s=1.0, factor=2.0, max_s=30.0)
BOOTSTRAP_TIMEOUT_MS = 5_000


def bootstrap_reachable(servers: Sequence[str], timeout: float = 1.0) -> bool:
    """True when one of the `host:port` servers accepts a TCP connection (a cheap check before a Kafka client)."""
    for server in servers:
        host, _, port = server.rpartition(":")
        try:
            with socket.create_connection((host or "localhost", int(port or 9092)), timeout=timeout):
                return True
        except (OSError, ValueError):
            continue
    return False


def quick_bootstrap(client_config: dict[str, Any]) -> dict[str, Any]:
    """kafka-python settings whose bootstrap gives up within 5 s (its default waits 30): the wait
    tries again, and a stop meanwhile is seen soon."""
    return {**client_config, "bootstrap_timeout_ms": BOOTSTRAP_TIMEOUT_MS}


def closed_on_failure(cls: Callable[..., T], **config: Any) -> T:
    """`cls(**config)` for kafka-python's KafkaConsumer or KafkaAdminClient; when the constructor
    raises, the I/O thread and client it had started are stopped before the error goes on."""
    client: Any = cls.__new__(cls)  # type: ignore[attr-defined]
    try:
        client.__init__(**config)
    except BaseException:
        for part, stop in (("_client", "close"), ("_net", "stop")):
            try:
                thing = getattr(client, part, None)
                if thing is not None:
                    getattr(thing, stop)()
            except Exception:  # noqa: BLE001 - the constructor's error is the one to raise
                log.debug("closing a half-made %s: %s", type(client).__name__, part, exc_info=True)
        raise
    return client


def _waited(exc: BaseException) -> bool:
    from kafka.errors import KafkaError

    return isinstance(exc, (ServiceUnavailable, TimeoutError)) or (isinstance(exc, KafkaError) and exc.retriable)


def until_kafka_answers(attempt: Callable[[], T], what: str, servers: Sequence[str],
                        stop: threading.Event | None = None, backoff: Backoff = BACKOFF) -> T | None:
    """`attempt()` until it returns, while Kafka at `servers` is unreachable or not ready (see the module
    doc); None when `stop` is set first. No attempt is made while no server accepts a connection.
    Any other error is raised at once."""
    tries = 0
    while True:
        if not bootstrap_reachable(servers):
            why = f"no broker accepts a connection at {','.join(servers)}"
        else:
            try:
                return attempt()
            except BaseException as exc:
                if not _waited(exc):
                    raise
                why = one_line(exc)[:300]
                if "bootstrap" in why.lower():
                    why += " (a broker still starting, or one refusing this client's login or TLS: its log says which)"
        tries += 1
        delay = backoff.delay(tries)
        log.warning("%s: Kafka not answering (%s); try %d in %.0f s", what, why, tries + 1, delay)
        if stop is not None:
            if stop.wait(delay):
                return None
        else:
            time.sleep(delay)
