"""Which attempt a resumed run is on: its own history, on this host and in the log.

A resumed run (`init(run_id=X, resume=True)`) publishes with attempt + 1 (see
CONTRACT.md, 'Resume'). Each rank finds its last attempt by itself, so the
ranks of one restart agree without talking to each other:

- a small state file per run and rank (`<AREAL_HOME>/runs/<run>/rank-<r>.json`),
  written at every start: works with the broker away, on the same host;
- the `run` events of that run and rank on the runs topic (the key's partition
  only: run events are few): works across hosts, without ClickHouse.

The next attempt is one more than the highest found; a rank with no history of
its own (a run that grew) joins the highest attempt any rank of the run logged.
Reading other ranks' events only in that case keeps a rank that starts late
from counting the new attempt its peers just announced.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from areal_metrics.producers.contract.events import RunEvent, ValidationError, parse_event
from areal_metrics.producers.contract.settings import Settings

log = logging.getLogger(__name__)


def state_path(home: Path, run_id: str, rank: int) -> Path:
    """Where this rank's last attempt is recorded under the state folder `home` (AREAL_HOME: init reads it)."""
    return home / "runs" / run_id / f"rank-{rank}.json"


def read_local(path: Path) -> int | None:
    """The last attempt recorded here, None when there is no (readable) record."""
    try:
        value = json.loads(path.read_text()).get("attempt")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def write_local(path: Path, attempt: int) -> None:
    """Best effort: a read-only home must not stop training."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"attempt": attempt, "ts": time.time()}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot record the attempt in %s: %s", path, exc)


def next_attempt(local: int | None, own_logged: int | None, any_logged: int | None) -> int:
    """The attempt a resumed rank starts (pure): one past its own last, else the run's latest, else 0."""
    own = max((a for a in (local, own_logged) if a is not None), default=None)
    if own is not None:
        return own + 1
    return any_logged if any_logged is not None else 0


def logged_attempts(settings: Settings, run_id: str, rank: int, timeout_s: float = 10.0) -> tuple[int | None, int | None]:
    """(highest attempt this rank logged, highest any rank logged) on the runs topic; (None, None) if unreadable.

    Reads the one partition the run's key maps to, from its start to its end
    offset at the time of the call, for at most `timeout_s`.
    """
    try:
        from kafka import KafkaConsumer, TopicPartition
    except ImportError:  # pragma: no cover - kafka-python is a dependency
        return None, None
    from areal_metrics.producers.runtime.kafka_wait import bootstrap_reachable, closed_on_failure
    from areal_metrics.producers.runtime.topic_metadata import key_partition

    topic = settings.topics.runs
    config = settings.kafka_python_config()
    if not bootstrap_reachable(config["bootstrap_servers"]):  # type: ignore[arg-type]
        log.warning("resume: the broker at %s is not reachable; using the local record only", settings.kafka_bootstrap)
        return None, None
    consumer: Any = None
    own = anyone = None
    try:
        deadline = time.monotonic() + timeout_s
        # the bootstrap within the same bound (kafka-python waits 30 s by default), and a consumer whose
        # bootstrap fails closed (else its I/O thread stays in the training process)
        consumer = closed_on_failure(KafkaConsumer, **config, group_id=None, enable_auto_commit=False,
                                     client_id="areal-client-resume", request_timeout_ms=int(timeout_s * 1000) + 1000,
                                     bootstrap_timeout_ms=max(1, int(timeout_s * 1000)))
        partitions = consumer.partitions_for_topic(topic)  # fetched if unknown; empty: no runs topic, no history
        if not partitions:
            return None, None
        ordered = sorted(partitions)
        key = run_id.encode()
        tp = TopicPartition(topic, ordered[key_partition(key, len(ordered))])
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        end = consumer.end_offsets([tp])[tp]
        while consumer.position(tp) < end and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                for r in records:
                    if r.key != key:
                        continue
                    try:
                        ev = parse_event(r.value, expected=RunEvent)
                    except ValidationError:
                        continue
                    anyone = ev.attempt if anyone is None else max(anyone, ev.attempt)
                    if ev.rank == rank:
                        own = ev.attempt if own is None else max(own, ev.attempt)
        if consumer.position(tp) < end:
            log.warning("resume: read only part of %s before the timeout; the attempt may be low", topic)
    except Exception as exc:
        log.warning("resume: cannot read %s (%s); using the local record only", topic, " ".join(str(exc).split())[:200])
    finally:
        if consumer is not None:
            try:
                consumer.close(autocommit=False)
            except Exception:
                pass
    return own, anyone
