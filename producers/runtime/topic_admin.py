"""Create missing topics from their specs (`areal_metrics.producers.contract.topics.TopicSpec`).

The one code path for every topic the project creates: the local stack (`areal-metrics up`,
the test fixtures) and the stream worker (its inputs on a fresh broker, its ticks) both
call `create_missing_topics`, with specs from `topic_spec` / `Topics.specs(settings)`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from areal_metrics.producers.contract.errors import ConfigError, ServiceUnavailable
from areal_metrics.producers.contract.topics import TopicSpec

_ALREADY_EXISTS = 36  # Kafka's TOPIC_ALREADY_EXISTS: another process created it first, which is fine


class TopicCreationError(ConfigError):
    """The broker refused a topic as specified (e.g. a replication factor above the broker count)."""


def _create(admin: Any, new: dict[str, Any], timeout: float) -> dict[str, Any]:
    """admin.create_topics, tried again until `timeout` while the cluster cannot take it yet (a new
    cluster's controller still settling raised from kafka-python); a topic made by an earlier try
    answers TOPIC_ALREADY_EXISTS, which the caller accepts. Past the deadline: ServiceUnavailable,
    one line naming kafka-python's error (the CLI prints it and exits 1, no traceback)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return admin.create_topics(new, timeout_ms=int(timeout * 1000), raise_errors=False)
        except Exception as exc:  # noqa: BLE001 - retried until the deadline
            if time.monotonic() > deadline:
                raise ServiceUnavailable(f"Kafka did not create topics {', '.join(sorted(new)[:3])}"
                                         f"{' …' if len(new) > 3 else ''} within {timeout:.0f} s "
                                         f"({type(exc).__name__}: {exc})") from exc
            time.sleep(0.5)


def create_missing_topics(admin: Any, specs: Sequence[TopicSpec], partitions: int, *,
                          timeout: float = 30.0) -> list[str]:
    """Create the topics of `specs` that do not exist (existing ones are left as they are).

    `admin` is a kafka-python `KafkaAdminClient`. Returns the names created; waits until
    every spec's topic is visible. TopicCreationError names the topic and Kafka's reason.
    """
    existing = set(admin.list_topics())
    new = {s.name: {"num_partitions": partitions, "replication_factor": s.replication_factor,
                    "configs": dict(s.config)}
           for s in specs if s.name not in existing}
    if new:
        response = _create(admin, new, timeout)
        refused = [t for t in response.get("topics", ()) if t.get("error_code") not in (0, _ALREADY_EXISTS)]
        if refused:
            t = refused[0]
            raise TopicCreationError(f"Kafka refused to create topic {t.get('name')}: "
                                     f"{t.get('error_message') or 'error code ' + str(t.get('error_code'))}")
    names = sorted({s.name for s in specs})
    deadline = time.monotonic() + timeout
    while missing := not_ready(admin, names):
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics not ready after {timeout:.0f}s: {', '.join(missing)}")
        time.sleep(0.1)
    while new and (lagging := not_hosted(admin, sorted(new))):
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics not on every replica after {timeout:.0f}s: {', '.join(lagging[:5])}")
        time.sleep(0.1)
    return sorted(new)


def not_hosted(admin: Any, names: Sequence[str]) -> list[str]:
    """Partitions of `names` that one of their replica brokers does not host yet ("topic[p]@broker"),
    and brokers that could not be asked yet ("@broker: <error>").

    On a cluster each broker learns of a new topic a moment after it exists, and a client
    that asks a broker which has not may take it for missing: Faust's consumer then sees
    its changelog with 0 partitions and refuses to write its table for minutes (seen on
    the three-broker test cluster under load). A broker creates a partition's log after
    its metadata holds the topic, so once every replica hosts its partitions, every
    broker of the replica set answers for the topic. Asks each broker itself
    (DescribeLogDirs). A broker not connected yet is lagging, not skipped: on a cluster
    just started, under load, the check once passed that way and a client then found a
    broker without the topics. Best effort only where the answer is refused: a broker that
    will not say (a principal not allowed to ask, docs/SECURITY.md; a client or broker
    without the call) is not asked, the others still are.
    """
    from kafka.errors import KafkaError

    try:
        descs = admin.describe_topics(list(names))
    except KafkaError as exc:
        return [f"metadata: {type(exc).__name__}"] if _transient(exc) else []
    except (TypeError, KeyError, AttributeError):
        return []
    known = {d.get("name") for d in descs if not d.get("error_code") and d.get("partitions")}
    lagging = [n for n in names if n not in known]  # the broker asked has not heard of them yet
    replicas: dict[int, dict[str, list[int]]] = {}
    for d in descs:
        for p in d.get("partitions") or ():
            for broker in p.get("replica_nodes") or ():
                replicas.setdefault(broker, {}).setdefault(d["name"], []).append(p["partition_index"])
    for broker, wanted in sorted(replicas.items()):
        try:
            answers = admin.describe_log_dirs(wanted, brokers=[broker])
            if not any(r["log_dirs"] for r in answers):
                # A broker has at least one log dir; none: it refused to say (a principal
                # without DESCRIBE on the cluster, docs/SECURITY.md), which is not "missing".
                continue
            hosted = {(t["name"], q["partition_index"])
                      for r in answers for ld in r["log_dirs"]
                      for t in ld.get("topics") or () for q in t.get("partitions") or ()}
        except KafkaError as exc:
            if _transient(exc):
                lagging.append(f"@{broker}: {type(exc).__name__}")
            continue  # a refusal: this broker is not asked (the others still are)
        except (TypeError, KeyError, AttributeError):
            continue  # an answer of another shape (another kafka-python): not asked
        lagging += [f"{t}[{p}]@{broker}" for t, ps in wanted.items() for p in ps if (t, p) not in hosted]
    return lagging


def _transient(exc: Exception) -> bool:
    """A broker not reachable or not answering yet, which asking again mends (kafka-python's retriable
    errors, and a broker the client's metadata does not know yet); not a refusal or a misuse."""
    import kafka.errors as errors

    mendable = (errors.RetriableError, getattr(errors, "UnknownBrokerIdError", errors.RetriableError))
    return isinstance(exc, mendable)


def not_ready(admin: Any, names: Sequence[str]) -> list[str]:
    """The topics of `names` not yet usable: unknown to the broker asked, or a partition without a leader.

    (On a cluster, a new topic reaches each broker's metadata a moment after it exists.)
    """
    if not names:
        return []
    ready = {d.get("name") for d in admin.describe_topics(list(names))
             if not d.get("error_code") and d.get("partitions")
             and all(p.get("leader_id", -1) >= 0 and not p.get("error_code") for p in d["partitions"])}
    return [n for n in names if n not in ready]
