"""The control topic, read in a background thread: `Run.commands()` hands over what arrived.

A command applies to this process when it is for its run and names no node,
or names this process's node. Reading starts from the offsets at `since` (the
run's start), so a command sent after `init` but before the consumer connected
is still seen, and an old command for a reused run id is not. Invalid
messages are skipped here: the sink dead-letters them for everyone.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from areal_metrics.producers.runtime.backoff import Backoff
from areal_metrics.producers.runtime.kafka_wait import bootstrap_reachable, closed_on_failure
from areal_metrics.producers.contract.events import CommandEvent, ValidationError, parse_event
from areal_metrics.producers.runtime.topic_metadata import known_partitions

log = logging.getLogger(__name__)
RETRY = Backoff(initial_s=1.0, max_s=30.0)  # the broker may be away for minutes
_TOPIC_WAIT_S = 10.0  # for the control topic's partitions, per try


def applies_to(command: CommandEvent, run_id: str, node: str) -> bool:
    return command.run_id == run_id and (command.target_node is None or command.target_node == node)


class ControlFeed:
    def __init__(self, kafka_config: dict[str, Any], topic: str, run_id: str, node: str, since: float) -> None:
        self._config = kafka_config
        self._topic = topic
        self._run_id = run_id
        self._key = run_id.encode()
        self._node = node
        self._since_ms = int(since * 1000)
        self._pending: list[CommandEvent] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.ready = threading.Event()  # set once the consumer is positioned
        self._thread = threading.Thread(target=self._run, name="areal-control", daemon=True)
        self._thread.start()

    def drain(self, every_node: bool = False) -> list[CommandEvent]:
        """The commands arrived since the last call: this node's (no `target_node`, or this node), or
        with `every_node` every one of the run's (the lead rank of a distributed loop hands them to
        all ranks); another node's are dropped otherwise."""
        with self._lock:
            out, self._pending = self._pending, []
        return out if every_node else [c for c in out if applies_to(c, self._run_id, self._node)]

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._consume()
                failures = 0
            except Exception as exc:  # noqa: BLE001 - the broker may come and go; training must not care
                failures += 1
                delay = RETRY.delay(failures)
                log.debug("control feed: %s; retrying in %.0f s", exc, delay)
                self._stop.wait(delay)

    def _consume(self) -> None:
        from kafka import KafkaConsumer, TopicPartition

        # No consumer while no broker accepts a connection, and none left running when its first contact
        # fails: kafka-python 3 starts a consumer's I/O thread before that contact and keeps it otherwise
        # (a trainer whose broker is away for an hour would gather a thread a minute).
        if not bootstrap_reachable(self._config["bootstrap_servers"]):
            raise ConnectionError("no broker accepts a connection")
        consumer = closed_on_failure(KafkaConsumer, **self._config, group_id=None, enable_auto_commit=False,
                                     auto_offset_reset="latest", client_id=f"areal-control-{self._run_id}"[:200])
        try:
            partitions = known_partitions(consumer, [self._topic], _TOPIC_WAIT_S, self._stop).get(self._topic)
            if self._stop.is_set():
                return
            if not partitions:  # not created yet: try again after a back-off (_run)
                raise LookupError(f"topic {self._topic} has no partitions yet")
            tps = [TopicPartition(self._topic, p) for p in sorted(partitions)]
            consumer.assign(tps)
            # The ends first: a command written after this lookup is past no end we
            # seek to (seeking to "the end" later could skip it).
            ends = consumer.end_offsets(tps)
            offsets = consumer.offsets_for_times({tp: self._since_ms for tp in tps})
            for tp in tps:
                found = offsets.get(tp)
                consumer.seek(tp, ends[tp] if found is None else found.offset)
                consumer.position(tp)  # resolve the lazy reset now, so `ready` means ready
            self.ready.set()
            while not self._stop.is_set():
                for records in consumer.poll(timeout_ms=200).values():
                    for record in records:
                        self._take(record.key, record.value)
        finally:
            consumer.close()

    def _take(self, key: bytes | None, raw: bytes | None) -> None:
        if key != self._key or raw is None:
            return  # another run's command (keys are run ids)
        try:
            event = parse_event(raw, expected=CommandEvent)
        except ValidationError:
            return
        assert isinstance(event, CommandEvent)
        if event.run_id != self._run_id or event.event_id in self._seen:  # the node: at drain()
            return
        self._seen.add(event.event_id)
        with self._lock:
            self._pending.append(event)
