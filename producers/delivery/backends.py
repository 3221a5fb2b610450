"""The Kafka producers the Publisher's sender thread hands messages to.

Two clients behind one small interface (`Producer`), with the same
guarantees: acks=all, idempotence (the broker drops a retried duplicate and
keeps the order per partition), the Java client's murmur2 partitioner (so a
run's key lands on the same partition whichever client sent it):

- confluent-kafka (librdkafka): batching, compression, the network and the
  retries run on native threads that never hold the GIL; the sender thread
  only calls `produce()` and serves the delivery callbacks (`poll`). Used
  when installed (the `fast` extra), because it takes a fraction of the
  training loop's time that kafka-python takes (docs/PERFORMANCE.md);
- kafka-python (pure Python, always installed): its I/O thread encodes and
  sends under the GIL, competing with the training loop.

`AREAL_KAFKA_CLIENT` (Settings.kafka_client) picks: `auto` (the default:
confluent-kafka when importable and every setting has a librdkafka spelling,
else kafka-python), `confluent-kafka` or `kafka-python`.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol
from areal_metrics.producers.contract.errors import ServiceUnavailable

log = logging.getLogger(__name__)

CLIENTS = ("auto", "confluent-kafka", "kafka-python")


class SendError(ServiceUnavailable):
    """The client refused a message at once (broker away, buffer full): the caller journals it."""


class Delivery(Protocol):
    @property
    def is_done(self) -> bool: ...

    def succeeded(self) -> bool: ...


class Producer(Protocol):
    name: str

    def send(self, topic: str, key: bytes, value: bytes) -> Delivery:
        """Hand one message over; raises SendError when the client cannot take it."""

    def poll(self) -> None:
        """Serve finished deliveries (mark their `Delivery` done); never blocks."""

    def flush(self, timeout: float) -> None: ...

    def close(self, timeout: float) -> None:
        """Stop; deliveries not done by then stay not done (the caller journals them)."""


def create(config: dict[str, Any], client: str = "auto", *, delivery_timeout_s: float) -> Producer:
    """A connected producer; raises SendError when the broker cannot be reached or a setting is wrong.

    `config`: connection settings in kafka-python's spelling (bootstrap_servers a list).
    """
    if client not in CLIENTS:
        raise ValueError(f"kafka client {client!r}: expected one of {', '.join(CLIENTS)}")
    if client != "kafka-python":
        rd_config = librdkafka_config(config)
        if rd_config is not None and _confluent_available():
            return _ConfluentProducer(rd_config, delivery_timeout_s)
        if client == "confluent-kafka":
            why = "is not installed" if rd_config is not None else "has no spelling for a setting given"
            raise ValueError(f"kafka client confluent-kafka {why} (settings: {', '.join(sorted(config))})")
    return _KafkaPythonProducer(config, delivery_timeout_s)


def _confluent_available() -> bool:
    try:
        import confluent_kafka  # noqa: F401
    except ImportError:
        return False
    return True


# kafka-python setting -> librdkafka property; settings outside this map keep kafka-python
_RD_NAMES = {
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
    "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location",
    "ssl_keyfile": "ssl.key.location",
    "linger_ms": "linger.ms",
    "acks": "acks",
    "enable_idempotence": "enable.idempotence",
    "compression_type": "compression.type",
}

# kafka-python's codec -> (its availability check in kafka.codec, the package that brings it)
_KAFKA_PYTHON_CODECS = {"gzip": ("has_gzip", "none: the standard library"), "snappy": ("has_snappy", "python-snappy"),
                        "lz4": ("has_lz4", "lz4"), "zstd": ("has_zstd", "zstandard")}


def compression_problem(codec: str | None, client: str = "auto") -> str | None:
    """Why the producer `client` would pick cannot compress with `codec` here; None when it can."""
    if codec is None or codec == "none":
        return None
    if client != "kafka-python" and _confluent_available():
        return None  # librdkafka: every codec built in
    import kafka.codec

    check, package = _KAFKA_PYTHON_CODECS[codec]
    if getattr(kafka.codec, check)():
        return None
    return (f"kafka-python cannot compress with {codec} without the {package} package: "
            f"pip install {package}, or confluent-kafka (pip install 'areal-metrics[fast]'), or choose gzip")


def librdkafka_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """kafka-python settings in librdkafka's spelling; None when one has no equivalent."""
    out: dict[str, Any] = {}
    for name, value in config.items():
        if name == "bootstrap_servers":
            out["bootstrap.servers"] = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
        elif name in _RD_NAMES:
            if value is not None:
                out[_RD_NAMES[name]] = value
        else:
            return None
    return out


class _Done:
    """A confluent-kafka delivery: set by the callback that `poll()` runs on the sender thread."""

    __slots__ = ("is_done", "ok")

    def __init__(self) -> None:
        self.is_done = False
        self.ok = False

    def __call__(self, err: Any, _msg: Any) -> None:
        self.ok = err is None
        self.is_done = True

    def succeeded(self) -> bool:
        return self.ok


class _ConfluentProducer:
    name = "confluent-kafka"

    def __init__(self, config: dict[str, Any], delivery_timeout_s: float) -> None:
        from confluent_kafka import Producer as RdProducer

        timeout_ms = int(delivery_timeout_s * 1000)
        self._producer = RdProducer({
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 20,  # batch: fewer, larger requests
            "partitioner": "murmur2_random",  # kafka-python's (and Java's) key -> partition
            "message.timeout.ms": timeout_ms,
            "request.timeout.ms": max(1000, min(timeout_ms // 2, 300_000)),
            "queue.buffering.max.messages": 1_000_000,  # the Publisher caps what is in flight
            **config,  # the caller's settings win
            "error_cb": _log_client_error,
            # librdkafka's log lines through Python logging (served by poll), not raw stderr, and at
            # DEBUG: what it logs are retries it makes itself ("Coordinator load in progress:
            # retrying"); a delivery that fails reaches the caller, and stderr stays the CLI's one line.
            "logger": _QuietLog(),
        })

    def send(self, topic: str, key: bytes, value: bytes) -> Delivery:
        from confluent_kafka import KafkaException

        done = _Done()
        try:
            self._producer.produce(topic, value, key, on_delivery=done)
        except (BufferError, KafkaException) as exc:
            raise SendError(str(exc)) from exc
        return done

    def poll(self) -> None:
        self._producer.poll(0)

    def flush(self, timeout: float) -> None:
        self._producer.flush(timeout)

    def close(self, timeout: float) -> None:
        self._producer.flush(timeout)
        # What is still queued is journaled by the caller: drop it here so close() returns at once.
        self._producer.purge(in_queue=True, in_flight=True, blocking=False)
        self._producer.poll(0)
        self._producer.close()


class _QuietLog:
    """A logger for librdkafka: every line at DEBUG, whatever its syslog level."""

    def log(self, _level: int, message: str, *args: Any) -> None:
        log.debug(message, *args)


def _log_client_error(err: Any) -> None:
    # librdkafka reports a broker that went away here and keeps retrying on its own
    log.debug("confluent-kafka: %s", err)


class _KafkaPythonProducer:
    name = "kafka-python"

    def __init__(self, config: dict[str, Any], delivery_timeout_s: float) -> None:
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        try:
            self._producer = KafkaProducer(**{
                "acks": "all",
                "enable_idempotence": True,
                "linger_ms": 20,  # batch: fewer, larger requests, less GIL time taken from training
                "max_block_ms": 1000,
                "bootstrap_timeout_ms": 5000,  # the sender must not hang in the constructor for long
                "request_timeout_ms": max(1000, int(delivery_timeout_s * 500)),
                "delivery_timeout_ms": int(delivery_timeout_s * 1000),
                **config,  # the caller's settings win
            })
        except KafkaError as exc:
            raise SendError(f"broker not available ({exc})") from exc
        # kafka-python closes every producer in an atexit hook of its own. Registered after the
        # publisher's (atexit runs last-in first-out), it would close this one before the
        # publisher's exit delivery re-sends the journal ("KafkaProducer already closed"); the
        # publisher closes it itself, so the hook goes.
        unregister = getattr(self._producer, "_unregister_cleanup", None)
        if callable(unregister):
            unregister()

    def send(self, topic: str, key: bytes, value: bytes) -> Delivery:
        from kafka.errors import KafkaError

        try:
            return self._producer.send(topic, key=key, value=value)  # its future: is_done, succeeded()
        except KafkaError as exc:  # metadata or buffer timeout: the broker is away
            raise SendError(str(exc)) from exc

    def poll(self) -> None:
        pass  # kafka-python's own I/O thread completes the futures

    def flush(self, timeout: float) -> None:
        self._producer.flush(timeout=timeout)

    def close(self, timeout: float) -> None:
        self._producer.close(timeout=timeout)
