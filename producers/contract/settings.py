"""Settings from the environment (CONTRACT.md, 'Settings').

Secrets (SASL password, TLS key passwords) are read from the environment or a
file and are never printed: `Settings.__repr__` masks them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.topics import DEFAULT_PREFIX, Topics

DEFAULT_STATE_DIR = ".areal"


def state_dir() -> Path:
    """Where the local stack keeps its state (broker data, store, pids, journals)."""
    return Path(os.environ.get("AREAL_HOME", DEFAULT_STATE_DIR)).absolute()


def _secret(name: str) -> str | None:
    """A secret from NAME or from the file named by NAME_FILE."""
    if os.environ.get(name):
        return os.environ[name]
    path = os.environ.get(name + "_FILE")
    if path:
        return Path(path).read_text().strip()
    return None


# The local stack (`areal-metrics up`) binds its broker here when the port is free,
# so a trainer with no settings at all reaches it. The CLI passes the bootstrap of
# the stack it started explicitly; this package never reads the stack's files.
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw[:40]!r}: expected a number") from None


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw[:40]!r}: expected an integer") from None


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _bool_env(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ConfigError(f"{name}={raw[:40]!r}: expected 1/0, true/false, yes/no or on/off")


def _choice_env(name: str, choices: tuple[str, ...], default: str) -> str:
    raw = (os.environ.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw not in choices:
        raise ConfigError(f"{name}={raw[:40]!r}: expected one of {', '.join(choices)}")
    return raw


def _ttl_days_env(name: str) -> int | None:
    """A number of days >= 1, or None when unset, empty or 0 (off)."""
    days = _int_env(name, 0)
    if days < 0:
        raise ConfigError(f"{name}={days}: expected a number of days >= 1 (0 or unset: keep forever)")
    return days or None


@dataclass(frozen=True)
class Settings:
    kafka_bootstrap: str = ""
    clickhouse_url: str = ""
    topic_prefix: str = DEFAULT_PREFIX
    # Kafka security (all optional; PLAINTEXT when unset)
    kafka_security_protocol: str = "PLAINTEXT"
    kafka_sasl_mechanism: str | None = None
    kafka_sasl_username: str | None = None
    kafka_sasl_password: str | None = field(default=None, repr=False)
    kafka_ssl_cafile: str | None = None
    kafka_ssl_certfile: str | None = None
    kafka_ssl_keyfile: str | None = None
    # Topic durability: replication factor and min.insync.replicas for every topic
    # the project creates (Faust's internal topics included); 3 and 2 on a cluster.
    kafka_replication_factor: int = 1
    kafka_min_insync_replicas: int = 1
    # Retention in ms (-1 = keep forever). Raw topics are the source of truth that
    # `replay` rebuilds from, so they are kept by default; derived topics likewise
    # unless configured.
    raw_retention_ms: int = -1
    derived_retention_ms: int = -1
    # ClickHouse on a cluster: DDL runs ON CLUSTER <clickhouse_cluster>, and with
    # `clickhouse_replicated` the tables use Replicated* engines (Keeper). Unset
    # AREAL_CLICKHOUSE_REPLICATED means "replicated when a cluster is named".
    clickhouse_cluster: str | None = None
    # Raw steps (table `steps`) older than this many days are deleted by ClickHouse's TTL
    # and hidden from `v_steps`; None keeps them (Kafka stays the source of truth: `replay`).
    clickhouse_steps_ttl_days: int | None = None
    # The client (`areal_metrics.init`): how long exit and finish() wait for the broker's
    # acknowledgement before leaving the rest in the journal.
    exit_timeout_s: float = 10.0
    clickhouse_replicated: bool = False
    # The Kafka client that delivers the trainers' events (areal_metrics.producers.delivery.backends): auto
    # (confluent-kafka when installed, else kafka-python), confluent-kafka or kafka-python.
    kafka_client: str = "auto"
    # The sink's ClickHouse HTTP endpoint (the embedded store): bounds of one `reader` query,
    # so that a heavy panel or a typo cannot take the CPU or memory of the process that
    # ingests (docs/CLICKHOUSE.md). Past `http_max_reader_queries` running at once, a reader
    # query waits up to `http_reader_queue_s`, then fails with TOO_MANY_SIMULTANEOUS_QUERIES.
    http_query_timeout_s: float = 30.0
    http_query_memory_bytes: int = 1 << 30
    http_max_reader_queries: int = 8
    http_reader_queue_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("http_query_timeout_s", "http_query_memory_bytes", "http_max_reader_queries"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"AREAL_{name.upper()}={getattr(self, name)}: expected a number > 0")
        if not self.http_reader_queue_s >= 0:
            raise ConfigError(f"AREAL_HTTP_READER_QUEUE_S={self.http_reader_queue_s}: expected a number >= 0")

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ.get
        return cls(
            kafka_bootstrap=env("AREAL_KAFKA_BOOTSTRAP") or DEFAULT_BOOTSTRAP,
            clickhouse_url=env("AREAL_CLICKHOUSE_URL") or f"chdb://{state_dir() / 'clickhouse'}",
            topic_prefix=env("AREAL_TOPIC_PREFIX", DEFAULT_PREFIX),
            kafka_security_protocol=env("AREAL_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT"),
            kafka_sasl_mechanism=env("AREAL_KAFKA_SASL_MECHANISM"),
            kafka_sasl_username=env("AREAL_KAFKA_SASL_USERNAME"),
            kafka_sasl_password=_secret("AREAL_KAFKA_SASL_PASSWORD"),
            kafka_ssl_cafile=env("AREAL_KAFKA_SSL_CAFILE"),
            kafka_ssl_certfile=env("AREAL_KAFKA_SSL_CERTFILE"),
            kafka_ssl_keyfile=env("AREAL_KAFKA_SSL_KEYFILE"),
            kafka_replication_factor=_int_env("AREAL_KAFKA_REPLICATION_FACTOR", 1),
            kafka_min_insync_replicas=_int_env("AREAL_KAFKA_MIN_INSYNC_REPLICAS", 1),
            raw_retention_ms=_int_env("AREAL_RAW_RETENTION_MS", -1),
            derived_retention_ms=_int_env("AREAL_DERIVED_RETENTION_MS", -1),
            clickhouse_cluster=env("AREAL_CLICKHOUSE_CLUSTER") or None,
            clickhouse_steps_ttl_days=_ttl_days_env("AREAL_CLICKHOUSE_STEPS_TTL_DAYS"),
            exit_timeout_s=_float_env("AREAL_EXIT_TIMEOUT_S", 10.0),
            clickhouse_replicated=_bool_env("AREAL_CLICKHOUSE_REPLICATED", bool(env("AREAL_CLICKHOUSE_CLUSTER"))),
            kafka_client=_choice_env("AREAL_KAFKA_CLIENT", ("auto", "confluent-kafka", "kafka-python"), "auto"),
            http_query_timeout_s=_float_env("AREAL_HTTP_QUERY_TIMEOUT_S", 30.0),
            http_query_memory_bytes=_int_env("AREAL_HTTP_QUERY_MEMORY_BYTES", 1 << 30),
            http_max_reader_queries=_int_env("AREAL_HTTP_MAX_READER_QUERIES", 8),
            http_reader_queue_s=_float_env("AREAL_HTTP_READER_QUEUE_S", 10.0),
        )

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)

    def kafka_python_config(self) -> dict[str, object]:
        """Connection settings in kafka-python's (and aiokafka's) spelling."""
        cfg: dict[str, object] = {
            "bootstrap_servers": self.kafka_bootstrap.split(","),
            "security_protocol": self.kafka_security_protocol,
        }
        if self.kafka_sasl_mechanism:
            quiet_client_debug_logs()
            cfg["sasl_mechanism"] = self.kafka_sasl_mechanism
            cfg["sasl_plain_username"] = self.kafka_sasl_username
            cfg["sasl_plain_password"] = self.kafka_sasl_password
        for name in ("cafile", "certfile", "keyfile"):
            value = getattr(self, f"kafka_ssl_{name}")
            if value:
                cfg[f"ssl_{name}"] = value
        return cfg

    def public(self) -> dict[str, object]:
        """Settings safe to print: secrets masked, passwords stripped from URLs."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if "password" in f.name and value:
                value = "***"
            out[f.name] = value
        out["clickhouse_url"] = mask_url(self.clickhouse_url)
        return out


# kafka-python and aiokafka log the bytes of a SASL handshake, password included, at
# DEBUG level: with credentials in play, their loggers never go below INFO.
_CLIENT_LOGGERS = ("kafka", "aiokafka")


def quiet_client_debug_logs() -> None:
    for name in _CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.INFO:
            logger.setLevel(logging.INFO)


def mask_url(url: str) -> str:
    """http://user:secret@host -> http://user:***@host"""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in creds else url
