"""Commands from the control topic: which ones apply to this run, and the reader.

Rank 0 reads `areal.control` in a background thread (`ControlListener`), so
the training loop never waits for Kafka; at each step it drains what arrived
and broadcasts it, and every rank applies the same commands at the same step
(`apply_commands`, pure).

A `scale_lr` with `args.from_step` (the stream worker's closed loop) waits
until that step boundary: `due(pending, step)` holds it back until the
step is reached, and since every rank holds the same broadcast commands,
every rank applies it after the same step.

A command for this run applies to the whole run, even when it names one of
the run's nodes in `target_node`: the ranks train in lockstep (one learning
rate, one stop), so a command one rank obeyed alone would split them. A
`target_node` that is not a node of this run makes the command someone else's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from producers.events import CommandEvent, ValidationError, parse_event

log = logging.getLogger(__name__)


def applies_to(command: CommandEvent, run_id: str, nodes: Iterable[str]) -> bool:
    if command.run_id != run_id:
        return False
    return command.target_node is None or command.target_node in set(nodes)


@dataclass
class Applied:
    """What a step's commands changed, for the trainer to act on and report."""

    lr_factor: float = 1.0
    stop: bool = False
    evaluate_now: bool = False
    eval_interval: int | None = None
    count: int = 0


def from_step(command: CommandEvent) -> int:
    """The step boundary after which a command applies (0: at once)."""
    value = command.args.get("from_step") if command.command == "scale_lr" else None
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 0


def due(pending: list[CommandEvent], step: int) -> tuple[list[CommandEvent], list[CommandEvent]]:
    """(the commands to apply after `step`, in arrival order; those that wait for a later boundary)."""
    return [c for c in pending if from_step(c) <= step], [c for c in pending if from_step(c) > step]


def apply_commands(commands: Iterable[CommandEvent], scheduler: Any) -> Applied:
    """Apply commands in order to the scheduler; return the rest for the trainer."""
    out = Applied()
    for cmd in commands:
        out.count += 1
        if cmd.command == "evaluate_now":
            scheduler.request()
            out.evaluate_now = True
        elif cmd.command == "set_eval_interval":
            scheduler.set_step_interval(int(cmd.args["steps"]))
            out.eval_interval = int(cmd.args["steps"])
        elif cmd.command == "scale_lr":
            out.lr_factor *= float(cmd.args["factor"])
        elif cmd.command == "stop":
            out.stop = True
    return out


class ControlListener:
    """Reads the control topic in a thread; `drain()` hands over what arrived, never blocking.

    It starts from the offsets at `since` (the launch time), so a command sent
    after launch but before this consumer connected is still seen, and an old
    command for a reused run id is not.
    """

    def __init__(self, kafka_config: dict[str, Any], topic: str, run_id: str, nodes: list[str], since: float,
                 dead_letter: Callable[[bytes, str, str, bytes], None] | None = None) -> None:
        self._config = kafka_config
        self._topic = topic
        self._run_id = run_id
        self._nodes = nodes
        self._since_ms = int(since * 1000)
        self._dead_letter = dead_letter  # (raw, reason, topic, key): the reporter's
        self._pending: list[CommandEvent] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.ready = threading.Event()  # set once partitions are assigned and positioned
        self._thread = threading.Thread(target=self._run, name="control-listener", daemon=True)

    def start(self) -> ControlListener:
        self._thread.start()
        return self

    def drain(self) -> list[CommandEvent]:
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                self._consume()
            except Exception as exc:  # the broker may come and go; training must not care
                log.warning("control listener: %s; retrying in %.0f s", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _consume(self) -> None:
        from kafka import KafkaConsumer, TopicPartition

        consumer = KafkaConsumer(**self._config, group_id=None, enable_auto_commit=False,
                                 auto_offset_reset="latest", client_id=f"areal-control-{self._run_id}")
        try:
            partitions = None
            while partitions is None and not self._stop.is_set():
                partitions = consumer.partitions_for_topic(self._topic)
                if partitions is None:
                    self._stop.wait(0.5)
            if partitions is None:
                return
            tps = [TopicPartition(self._topic, p) for p in sorted(partitions)]
            consumer.assign(tps)
            offsets = consumer.offsets_for_times({tp: self._since_ms for tp in tps})
            for tp in tps:
                found = offsets.get(tp)
                if found is None:
                    consumer.seek_to_end(tp)
                else:
                    consumer.seek(tp, found.offset)
            for tp in tps:
                consumer.position(tp)  # resolve lazily-reset offsets now, so `ready` means ready
            self.ready.set()
            while not self._stop.is_set():
                for records in consumer.poll(timeout_ms=200).values():
                    for record in records:
                        self._take(record.key, record.value)
        finally:
            consumer.close()

    def _take(self, key: bytes | None, raw: bytes) -> None:
        if key is not None and key != self._run_id.encode():
            return  # another run's command (keys are run ids); not ours to judge
        try:
            event = parse_event(raw, expected=CommandEvent)
        except ValidationError as exc:
            if self._dead_letter is not None and key is not None:
                self._dead_letter(raw, str(exc), self._topic, key)
            return
        assert isinstance(event, CommandEvent)
        if not applies_to(event, self._run_id, self._nodes) or event.event_id in self._seen:
            return
        self._seen.add(event.event_id)
        with self._lock:
            self._pending.append(event)
        log.info("command %s %s from the control topic", event.command, dict(event.args))

