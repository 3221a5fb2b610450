"""What the worker needs to know about topics before Faust starts: partition counts.

Faust tables must have as many partitions as the topics that feed them, and a run's
steps, evals and clock ticks must land on the same partition number, so the worker reads
the partition count of its input topics and creates what is missing (its ticks topic,
and input topics on a fresh broker).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from areal_metrics.producers.runtime.kafka_wait import closed_on_failure
from areal_metrics.producers.runtime.topic_admin import create_missing_topics
from areal_metrics.producers.contract.topics import DurabilitySettings, TopicSpec, topic_spec
from areal_metrics.producers.contract.errors import UserError

log = logging.getLogger("streams")

DEFAULT_PARTITIONS = 3
KAFKA_DEFAULT_MAX_MESSAGE_BYTES = 1_048_588  # a broker's message.max.bytes, unless set
TICKS_RETENTION_MS = 60 * 60 * 1000  # ticks are worthless after a moment; keep an hour
# a copy sent on to its run's partition is read within moments; a week covers a worker that was down,
# and its original stays in the input topic (which the sink stores) for as long as that is kept
REPARTITION_RETENTION_MS = 7 * 24 * 60 * 60 * 1000


class TopicLayoutError(UserError, RuntimeError):
    """Input topics the worker cannot process together."""


def prepare_topics(
    bootstrap: str, inputs: Iterable[str], ticks: str, *, timeout: float = 30.0, client_config: dict | None = None,
    durability: DurabilitySettings | None = None, changelogs: Iterable[str] = (),
    changelog_max_bytes: int | None = None, repartitions: Iterable[str] = (), repartition_bytes: int | None = None,
) -> int:
    """Partition count shared by the input topics; creates missing inputs, the ticks topic and `changelogs`.

    Created topics are specified by `areal_metrics.producers.contract.topics.topic_spec` from `durability`
    (`Settings`: replication factor, min.insync.replicas, retention; inputs are raw
    topics, the ticks derived ones with a retention of an hour); None: the broker's
    defaults. The same creation code as the local stack (`areal_metrics.producers.runtime.topic_admin`), which
    waits until every replica broker has a new topic. `changelogs`: Faust's table
    changelogs (compacted), made here so that every broker knows them before Faust asks, taking
    records of `changelog_max_bytes` (max.message.bytes; None: the broker's default). `repartitions`:
    the worker's repartition topics (as many partitions as the inputs, taking records of
    `repartition_bytes`).
    """
    from kafka import KafkaAdminClient

    inputs = list(inputs)
    config = dict(client_config or {})
    config.setdefault("bootstrap_servers", bootstrap.split(","))
    admin = closed_on_failure(KafkaAdminClient, request_timeout_ms=int(timeout * 1000), **config)
    try:
        counts = _partition_counts(admin, inputs)
        present = {t: n for t, n in counts.items() if n}
        if len(set(present.values())) > 1:
            raise TopicLayoutError(
                "input topics have different partition counts "
                + ", ".join(f"{t}={n}" for t, n in sorted(present.items()))
                + "; a run's steps, evals and run events must share a partition number"
            )
        partitions = next(iter(present.values()), DEFAULT_PARTITIONS)
        specs = [_spec(t, durability, derived=False) for t in inputs if not counts.get(t)]
        if not _partition_counts(admin, [ticks])[ticks]:
            specs.append(ticks_spec(ticks, durability))
        changelogs, repartitions = list(changelogs), list(repartitions)
        specs += [changelog_spec(t, durability, changelog_max_bytes)
                  for t, n in _partition_counts(admin, changelogs).items() if not n]
        specs += [repartition_spec(t, durability, repartition_bytes)
                  for t, n in _partition_counts(admin, repartitions).items() if not n]
        create_missing_topics(admin, specs, partitions, timeout=timeout)
        deadline = time.monotonic() + timeout
        while not all(_partition_counts(admin, [*inputs, ticks, *repartitions]).values()):
            if time.monotonic() > deadline:
                raise TimeoutError("topics did not appear: " + ", ".join(s.name for s in specs))
            time.sleep(0.1)
        for topic, count in _partition_counts(admin, [ticks, *repartitions]).items():
            if count != partitions:
                raise TopicLayoutError(f"{topic} has {count} partitions, the inputs have {partitions}")
        return partitions
    finally:
        admin.close()


def _spec(name: str, durability: DurabilitySettings | None, *, derived: bool) -> TopicSpec:
    if durability is None:
        return TopicSpec(name, -1)  # the broker's default replication and configs
    return topic_spec(name, durability, derived=derived)


def changelog_spec(name: str, durability: DurabilitySettings | None, max_bytes: int | None = None) -> TopicSpec:
    """A table's changelog, as Faust makes it: compacted (the latest state per run kept), replicated;
    taking records of `max_bytes` (None: the broker's default, 1 MB unless set)."""
    spec = _spec(name, durability, derived=True)
    config = {k: v for k, v in spec.config.items() if not k.startswith("retention.")}
    config["cleanup.policy"] = "compact"
    if max_bytes is not None:
        config["max.message.bytes"] = str(max_bytes)
    return TopicSpec(name, spec.replication_factor, config)


def repartition_spec(name: str, durability: DurabilitySettings | None, max_bytes: int | None = None) -> TopicSpec:
    """A repartition topic: input messages sent on to their run's partition, replicated like a derived
    topic, kept REPARTITION_RETENTION_MS; taking records of `max_bytes` (`repartition_max_bytes`)."""
    spec = _spec(name, durability, derived=True)
    config = {k: v for k, v in spec.config.items() if not k.startswith("retention.")}
    config["retention.ms"] = str(REPARTITION_RETENTION_MS)
    if max_bytes is not None:
        config["max.message.bytes"] = str(max_bytes)
    return TopicSpec(name, spec.replication_factor, config)


def repartition_max_bytes(state_record_max_bytes: int, message_max_bytes: int) -> int:
    """The largest copy a repartition topic takes: any input a reader accepts with room for its key
    (AREAL_MAX_MESSAGE_BYTES), and at least Kafka's default and the state record bound. A larger input
    (one a reader refuses as too large) is processed where it landed instead."""
    return max(state_record_max_bytes, message_max_bytes + (64 << 10), KAFKA_DEFAULT_MAX_MESSAGE_BYTES)


def max_message_bytes(bootstrap: str, topic: str, *, timeout: float = 30.0,
                      client_config: dict | None = None) -> int | None:
    """The topic's max.message.bytes as the broker applies it (its own, else the broker's default);
    None when the broker does not say, or does not let us ask (no DESCRIBE_CONFIGS on the topic:
    kafka-python then answers an empty config, no error; docs/SECURITY.md grants it to the worker). A
    changelog made before the worker set it keeps its limit, and a state record over it would be
    refused: the worker bounds its records by it too."""
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType
    from kafka.errors import KafkaError

    config = dict(client_config or {})
    config.setdefault("bootstrap_servers", bootstrap.split(","))
    admin = closed_on_failure(KafkaAdminClient, request_timeout_ms=int(timeout * 1000), **config)
    try:
        found = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)], config_filter="all")
    except KafkaError as exc:
        log.warning("could not read %s's max.message.bytes (%s: %s)", topic, type(exc).__name__, exc)
        return None
    finally:
        admin.close()
    entry = (found.get("topic") or {}).get(topic, {}).get("max.message.bytes")
    value = entry.get("value") if isinstance(entry, dict) else None
    return int(value) if isinstance(value, str) and value.isdigit() else None


def ticks_spec(name: str, durability: DurabilitySettings | None) -> TopicSpec:
    """The worker's clock ticks: replicated like a derived topic, but kept an hour only."""
    spec = _spec(name, durability, derived=True)
    config = {k: v for k, v in spec.config.items() if k != "retention.bytes"}
    config["retention.ms"] = str(TICKS_RETENTION_MS)
    return TopicSpec(name, spec.replication_factor, config)


def _partition_counts(admin: object, topics: list[str]) -> dict[str, int]:
    """Partitions per topic, 0 for a topic that does not exist (never auto-creates one)."""
    existing = set(admin.list_topics())  # type: ignore[attr-defined]
    out: dict[str, int] = {t: 0 for t in topics}
    asked = [t for t in topics if t in existing]
    if asked:
        for desc in admin.describe_topics(asked):  # type: ignore[attr-defined]
            name = desc.get("name", desc.get("topic"))
            if name in out and not desc.get("error_code"):
                out[name] = len(desc.get("partitions") or ())
    return out


def ensure_committed_offsets(
    bootstrap: str,
    group_id: str,
    *,
    from_start: list[str],
    from_end: list[str],
    timeout: float = 60.0,
    client_config: dict | None = None,
) -> int:
    """Give every input partition of the worker's group a committed offset before Faust starts.

    Faust drops messages it fetched while its flow was suspended (a rebalance, table
    recovery) and gets them back by seeking to the committed offset. A partition the
    group never committed has nothing to seek to, so those messages would be skipped
    until the next restart: seen with a worker killed before its first commit. So the
    worker commits "the beginning" (inputs) or "the end" (its ticks) for every partition
    without a committed offset. A commit from outside the group only succeeds while the
    group has no live member; after a kill -9 that is once the dead member's session has
    expired, so this waits for that (the worker could not join any sooner anyway).
    Returns how many partitions got an offset; -1 when the group kept a live member all
    along (another worker is running: it has committed or will commit on its own).
    """
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import KafkaError
    from kafka.structs import OffsetAndMetadata

    config = dict(client_config or {})
    config.setdefault("bootstrap_servers", bootstrap.split(","))
    consumer = closed_on_failure(KafkaConsumer, group_id=group_id, enable_auto_commit=False, **config)
    try:
        tps_start = [TopicPartition(t, p) for t in from_start for p in sorted(consumer.partitions_for_topic(t) or ())]
        tps_end = [TopicPartition(t, p) for t in from_end for p in sorted(consumer.partitions_for_topic(t) or ())]
        tps = tps_start + tps_end
        if not tps:
            return 0
        consumer.assign(tps)
        missing = [tp for tp in tps if consumer.committed(tp) is None]
        if not missing:
            return 0
        starts = consumer.beginning_offsets([tp for tp in missing if tp in tps_start])
        ends = consumer.end_offsets([tp for tp in missing if tp in tps_end])
        offsets = {tp: OffsetAndMetadata(off, "", -1) for tp, off in {**starts, **ends}.items()}
        deadline = time.monotonic() + timeout
        while True:
            try:
                consumer.commit(offsets)
                return len(offsets)
            except KafkaError:
                # The group still has a member (a dead one until its session expires), or
                # a live worker committed meanwhile: check again.
                if all(consumer.committed(tp) is not None for tp in missing):
                    return 0
                if time.monotonic() > deadline:
                    return -1
                time.sleep(1.0)
    finally:
        consumer.close()
