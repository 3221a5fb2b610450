"""The worker's logic for a batch of messages, without Faust: bytes in, outputs sent, state saved.

`StreamCore.on_batch` takes messages in arrival order (any mix of input topics and runs)
and, per run: loads its state once, runs the pure core (areal_metrics.streams.core.processor) over the run's
events in their order, sends every output, waits until the broker has those that must
exist once (consensus, commands, alerts), and only then saves the run's state once
(areal_metrics.streams.state.state_store: the records that changed). If the worker dies in between, the batch
is read again from the saved state and gives the same events with the same event_ids.
`on_input` is a batch of one; `on_tick` is the clock for the runs of one partition.

Live runs are bounded: a run leaves the state (memory, table and changelog) once it has had
no input for `run_idle_s` (`ended_run_idle_s` when it has ended) and nothing of it waits on
the clock (a step's missing ranks, an open vote round, a stall alert not yet raised), or at
once when more than `max_runs` runs are live (the one whose last input is oldest first). A run
that comes back after that starts over as a new run would (AREAL_WORKER_RUN_IDLE_S,
AREAL_WORKER_ENDED_RUN_IDLE_S, AREAL_WORKER_MAX_RUNS; docs/STREAMS.md).

Bad input never raises: it becomes a dead letter (with a rate-limited alert) in its run's
turn. A bug while processing one message dead-letters that message; a state that cannot
be saved makes its run's messages go through again one by one, so the failing one is
found and dead-lettered as before batching.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from msgspec.structs import replace

from areal_metrics.producers.contract.deadletter import letter_ts, rejected
from areal_metrics.producers.contract.events import (
    CommandAckEvent,
    EvalEvent,
    Event,
    RejectedEvent,
    RunEvent,
    StepEvent,
    ValidationError,
    parse_event,
)
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.producers.runtime.poison import poison_events
from areal_metrics.producers.runtime.topic_metadata import key_partition
from areal_metrics.streams.core.config import StreamsConfig
from areal_metrics.streams.core.processor import (
    WORKER_NODE,
    Output,
    RunState,
    derived_id,
    has_clock_work,
    on_command_ack,
    on_eval,
    on_rejected,
    on_run,
    on_step,
    on_tick,
    round_key,
)
from areal_metrics.streams.shell.record_batches import Message, RecordRefused, settled
from areal_metrics.streams.shell.settings import WorkerSettings
from areal_metrics.streams.state.state_store import StateRecordTooLarge, StateStore

log = logging.getLogger("streams")

# Sends one message; returns an awaitable that completes when the broker has it.
SendFn = Callable[[str, bytes, bytes], Awaitable[Awaitable[Any]]]
# Sends messages in their order; one awaitable per message, as SendFn's (areal_metrics.streams.shell.record_batches).
SendManyFn = Callable[[Sequence[Message]], Awaitable[list[Awaitable[Any]]]]
# Sends changelog records of the table, in their order (partition, key, value; None: a tombstone).
ChangelogFn = Callable[[list[tuple[int, bytes, "bytes | None"]]], Awaitable[Any]]


# frozen Structs: made per input message, and their __init__ costs a tenth of a frozen dataclass's
class Input(msgspec.Struct, frozen=True, gc=False):
    """One message of an input topic."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: float | None = None  # the Kafka message's (s): a dead letter's `ts`, the same on a redelivery


class _Item(msgspec.Struct, frozen=True, gc=False):
    """An input's event (or its dead letter) in its run's turn."""

    message: Input
    event: Event


@dataclass
class StreamCore:
    """`table` is any mutable mapping bytes -> bytes (Faust's table in the worker). The
    outputs go out through `send_many` (a batch's outputs in one call: the worker's record
    batches) or else `send`, one message at a time. `changelog`, when given, sends a Faust
    table's changelog records (after each batch and tick, in the order they were written)
    instead of the table's own `send_changelog`, whose per-record buffer and tasks cost more
    than the rest of a record's work; the consumer's commit flushes the producer first
    either way."""

    topics: Topics
    config: StreamsConfig
    table: Any
    send: SendFn | None = None
    clock: Callable[[], float] = time.time
    changelog: ChangelogFn | None = None
    send_many: SendManyFn | None = None
    stats: dict[str, int] = field(default_factory=lambda: {"steps": 0, "evals": 0, "runs": 0, "rejected": 0,
                                                            "ticks": 0, "outputs": 0, "errors": 0, "batches": 0,
                                                            "evicted": 0, "evicted_over_cap": 0})
    # The bound on live runs (None: the settings AREAL_WORKER_RUN_IDLE_S, _ENDED_RUN_IDLE_S, _MAX_RUNS)
    run_idle_s: float | None = None
    ended_run_idle_s: float | None = None
    max_runs: int | None = None
    # The largest state record, overhead included (None: AREAL_WORKER_STATE_RECORD_MAX_BYTES); the
    # entry point passes the smaller of it and the changelog topic's max.message.bytes
    state_record_max_bytes: int | None = None
    # A run's state lives on its partition: the one its run_id key maps to. An input on another one
    # (no key, another key, another partitioner) would, with several workers, start a second state of
    # the run where it landed. `reroute`: each input topic's repartition topic, where such an input goes
    # to its run's partition (of `partitions`), to be processed there; None: processed where it lands
    # (one worker, or tests of the core alone).
    reroute: Mapping[str, str] | None = None
    partitions: int = 0
    reroute_max_bytes: int | None = None  # the largest copy a repartition topic takes (None: no bound)

    def __post_init__(self) -> None:
        if self.send_many is None and self.send is None:
            raise TypeError("StreamCore needs `send` or `send_many`")
        self._send_all: SendManyFn = self.send_many or self._one_by_one
        # None: the settings' defaults (the entry point passes the environment's values)
        if self.state_record_max_bytes is None:
            self.state_record_max_bytes = WorkerSettings().worker_state_record_max_bytes
        self.store = StateStore(self.table, direct_changelog=self.changelog is not None,
                                max_record_bytes=self.state_record_max_bytes)
        self._bad_partition: dict[str, int] = {}
        if self.run_idle_s is None:
            self.run_idle_s = WorkerSettings().worker_run_idle_s
        if self.ended_run_idle_s is None:
            self.ended_run_idle_s = WorkerSettings().worker_ended_run_idle_s
        if self.max_runs is None:
            self.max_runs = WorkerSettings().worker_max_runs
        self._types: dict[str, type[Event]] = {self.topics.steps: StepEvent, self.topics.acks: CommandAckEvent,
                                               self.topics.runs: RunEvent}
        self._origins: dict[str, str] = {}  # repartition topic -> its input topic
        for origin, copy in (self.reroute or {}).items():  # a repartition topic carries its origin's events
            self._types[copy] = self._types.get(origin, EvalEvent)
            self._origins[copy] = origin
        if self.reroute is not None and self.partitions < 1:
            raise ValueError("reroute needs the input topics' partition count")
        self._homes: dict[str, int] = {}  # run_id -> its partition (murmur2 in pure Python: 3 us, once a run)
        self._seen: dict[str, float] = {}  # live run -> worker clock of its last input, oldest first
        self._unsaved_said: dict[str, float] = {}  # run -> when its tick's unsaved state was last logged
        self._unsaved: set[str] = set()  # runs whose cached state is a tick's that was never stored
        self._ended: dict[str, float] = {}  # the ended ones among them, the same way

    # ---------------------------------------------------------------- state

    @property
    def cache(self) -> dict[str, RunState]:
        """Decoded states, as last saved."""
        return self.store.states

    def load(self, run_id: str, partition: int) -> RunState:
        """The run's state; a new one lives on `partition`, or with `reroute` on the run's own (its
        records must not start a second state where a message of the run happened to land)."""
        state = self.store.load(run_id)
        if state is None or state.partition is None:
            partition = self._new_state_partition(run_id, partition)
        if state is None:
            if any(b.run_id == run_id for b in self.store.bad):
                self.stats["bad_states"] = self.stats.get("bad_states", 0) + 1
                self._bad_partition.setdefault(run_id, partition)
            state = RunState(run_id, partition=partition)
        if state.partition is None:
            state = replace(state, partition=partition)
        return state

    def _new_state_partition(self, run_id: str, landed: int) -> int:
        """Where a new state of the run lives: its own partition with `reroute` on, else where its message
        (or the tick that found it) landed."""
        return self._home(run_id) if self.reroute is not None else landed

    def _home(self, run_id: str) -> int:
        """The partition the run's key maps to (murmur2 in pure Python: 3 us, once a run)."""
        home = self._homes.get(run_id)
        if home is None:
            if len(self._homes) >= 1 << 16:  # a bound: the runs seen lately come back at 3 us each
                self._homes.clear()
            home = self._homes[run_id] = key_partition(run_id.encode(), self.partitions)
        return home

    def _held_elsewhere(self, run_id: str, partitions: Sequence[int]) -> bool:
        """With `reroute` on, messages of a run this worker holds no state of, each processed off the run's
        partition (too large to send on; a dead letter whose key names another run): the run's partition
        may be another worker's, whose state of the run this one must not write. Their letters go out
        from a state of the moment, not kept. One of them on the run's partition: the partition is this
        worker's, and the state is kept."""
        if self.reroute is None or self.store.holds(run_id):
            return False
        home = self._home(run_id)
        return all(p != home for p in partitions)

    def save(self, state: RunState) -> None:
        self.store.save(state)
        self._unsaved.discard(state.run_id)  # what the table holds is this state now

    def forget_cache(self) -> None:
        self.store.forget()
        self._seen.clear()  # the table's runs are seen again at the next tick
        self._ended.clear()
        self._unsaved.clear()  # (an unsaved tick state is gone with the cache: the table's is read again)

    # ---------------------------------------------------------------- the bound on live runs

    @property
    def live_runs(self) -> int:
        return len(self._seen)

    def _touch(self, run_id: str, seen: float, state: RunState) -> None:
        """The run had input at `seen`: it goes to the end of the line."""
        self._seen.pop(run_id, None)
        self._seen[run_id] = seen
        self._ended.pop(run_id, None)
        if state.lifecycle.ended:
            self._ended[run_id] = seen

    def _waits(self, run_id: str, now: float) -> bool:
        """Does something of the run wait on the clock (it must not leave before that is done)?"""
        state = self.store.load(run_id)
        if state is None:
            return False
        cfg = self.config.for_run(run_id)
        stall = state.stall
        stall_due = cfg.stall_seconds > 0 and not stall.stalled and not state.lifecycle.ended \
            and stall.last_step_at is not None  # a `stalled` alert not raised yet
        return bool(state.ranks.pending or state.votes.open_rounds or stall_due or has_clock_work(state, now, cfg))

    def _evict(self, run_id: str) -> None:
        state = self.store.load(run_id)
        partition = state.partition if state is not None and state.partition is not None else \
            self._bad_partition.get(run_id, 0)
        self.store.evict(run_id, partition)
        self._seen.pop(run_id, None)
        self._ended.pop(run_id, None)
        self._unsaved.discard(run_id)
        self.stats["evicted"] += 1

    def evict_idle(self, now: float) -> None:
        """Runs idle past their limit, with nothing waiting on the clock, leave the state."""
        for line, limit in ((self._ended, self.ended_run_idle_s), (self._seen, self.run_idle_s)):
            assert limit is not None
            due = []
            for run_id, seen in line.items():  # oldest first: stop at the first one not due
                if now - seen < limit:
                    break
                due.append(run_id)
            for run_id in due:
                if run_id in self._seen and not self._waits(run_id, now):
                    log.info("streams: run %r left the worker's state (no input for %.0f s)", run_id, now - line[run_id])
                    self._evict(run_id)

    def evict_over_cap(self) -> None:
        """More than `max_runs` live runs: the ones whose last input is oldest leave, whatever waits in them."""
        assert self.max_runs is not None
        over = len(self._seen) - self.max_runs
        if over <= 0:
            return
        log.warning("streams: %d live runs, more than AREAL_WORKER_MAX_RUNS=%d; the %d with the oldest input leave "
                    "the worker's state", len(self._seen), self.max_runs, over)
        for run_id in list(self._seen)[:over]:
            self._evict(run_id)
        self.stats["evicted_over_cap"] += over

    async def send_changelog(self) -> None:
        """The state records saved since the last call, to the table's changelog."""
        if self.changelog is None:
            return
        records = self.store.io.take()
        if records:
            await self.changelog(records)

    # ---------------------------------------------------------------- output

    async def emit(self, outputs: list[Output]) -> None:
        if not outputs:
            return
        topic_of = self.topics.for_event
        delivered = await self._send_all([(topic_of(o.event), None, o.event.run_id.encode(), o.event.to_json())
                                          for o in outputs])
        self.stats["outputs"] += len(outputs)
        await settled(fut for out, fut in zip(outputs, delivered) if out.must_ack)

    async def _one_by_one(self, messages: Sequence[Message]) -> list[Awaitable[Any]]:
        assert self.send is not None
        return [await self.send(topic, key, value) for topic, _, key, value in messages]  # type: ignore[arg-type]

    # ---------------------------------------------------------------- inputs

    async def on_input(
        self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
        timestamp: float | None = None,
    ) -> None:
        """One message from areal.steps, areal.evals, areal.runs or areal.acks. Never raises for bad input."""
        await self.on_batch([Input(topic, partition, offset, key, value, timestamp)])

    async def on_batch(self, messages: Sequence[Input]) -> None:
        """Messages in arrival order; per run one load, one round of outputs, one save. A message off its
        run's partition goes to its repartition topic instead (delivered before the batch is acknowledged)."""
        self.stats["batches"] += 1
        by_run: dict[str, list[_Item]] = {}
        away: list[Message] = []
        for m in messages:
            item = self._read(m)
            if (copy := self._rerouted(item)) is not None:
                away.append(copy)
                continue
            by_run.setdefault(item.event.run_id, []).append(item)
        if away:
            await settled(await self._send_all(away))
            self.stats["rerouted"] = self.stats.get("rerouted", 0) + len(away)
        now = self.clock()
        loaded: dict[str, RunState] = {}
        states: dict[str, RunState] = {}
        outputs: list[Output] = []
        turns = list(by_run.items())
        passing: set[str] = set()  # runs whose state here is of the moment (`_held_elsewhere`)
        while turns:
            run_id, items = turns.pop(0)
            if run_id not in states:
                if self._held_elsewhere(run_id, [i.message.partition for i in by_run.get(run_id, items)]):
                    passing.add(run_id)
                states[run_id] = loaded[run_id] = self.load(run_id, items[0].message.partition)
            states[run_id], out, failed = self._apply(states[run_id], items, now)
            outputs.extend(out)
            turns.extend((item.event.run_id, [item]) for item in failed)  # dead letters of other runs
        await self.emit(outputs)
        for run_id, state in states.items():
            if run_id in passing:
                self.stats["not_kept_elsewhere"] = self.stats.get("not_kept_elsewhere", 0) + 1
                continue
            before = loaded[run_id]
            if state is not before and state != before:
                await self._save(state, by_run.get(run_id, []))
            self._touch(run_id, now, state)
        await self.dead_letter_bad_states(messages[0].partition if messages else 0)
        self.evict_over_cap()
        await self.send_changelog()

    async def on_poison(self, m: Input, crashes: int) -> None:
        """A message that crashed the worker `crashes` times: not processed again; its dead letter
        and a `poison_message` alert go out (ids from its position: the same after another crash)."""
        self.stats["poison"] = self.stats.get("poison", 0) + 1
        log.error("streams: %s/%s/%s crashed the worker %d times; dead-lettered and skipped", m.topic, m.partition,
                  m.offset, crashes)
        key, topic, partition, offset = self._published(m)
        dead, alert = poison_events(m.value, key, topic, partition, offset, crashes,
                                    service="stream worker", node=WORKER_NODE, ts=m.timestamp, now=self.clock())
        await self.emit([Output(dead), Output(alert)])

    def input_type(self, topic: str) -> type[Event]:
        """The event type an input topic carries (anything but steps, runs and acks, and their repartition
        topics, is read as evals)."""
        return self._types.get(topic, EvalEvent)

    def _rerouted(self, item: _Item) -> Message | None:
        """The message as a record of its topic's repartition topic on its run's partition, when it is read
        on another one (None: it is on its run's partition, or is a copy already). A dead letter goes too: it
        counts in its run's state (the rate of its alerts), which is kept on the run's partition only."""
        m, run_id, reroute = item.message, item.event.run_id, self.reroute
        if reroute is None or m.topic not in reroute:
            return None
        home = self._home(run_id)
        if home == m.partition:
            return None
        if self.reroute_max_bytes is not None and len(m.value or b"") + (1 << 10) > self.reroute_max_bytes:
            self.stats["too_large_to_reroute"] = self.stats.get("too_large_to_reroute", 0) + 1
            return None  # larger than any input a reader takes: its dead letter is made where it landed
        # keyed by where it was published (its run first): its dead letter is then the same letter however
        # often it is sent on (the original is read again after a crash before its acknowledgement)
        key = json.dumps([run_id, m.topic, m.partition, m.offset], separators=(",", ":")).encode()
        return (reroute[m.topic], home, key, m.value)

    def _read(self, m: Input) -> _Item:
        """The message's event, or its dead letter."""
        expected = self.input_type(m.topic)
        try:
            if m.value is None:
                raise ValidationError(expected.table, "empty message (null value)")
            return _Item(m, parse_event(m.value, expected=expected))
        except ValidationError as err:
            return _Item(m, self._dead(m, str(err)))

    def _published(self, m: Input) -> tuple[bytes | None, str, int, int]:
        """(key, topic, partition, offset) of the message as it was published: a copy's, as its key says
        (`_rerouted`); its own otherwise. A dead letter's and a poison message's ids and text come from it,
        so a copy sent again (the original read again after a crash) is the same letter."""
        if m.topic in self._origins and m.key is not None:
            try:
                run_id, topic, partition, offset = json.loads(m.key)
            except (ValueError, TypeError):
                pass
            else:
                if (type(run_id) is str and type(topic) is str and type(partition) is int
                        and type(offset) is int):
                    return run_id.encode(), topic, partition, offset
        return m.key, m.topic, m.partition, m.offset

    def _position(self, m: Input) -> str:
        _, topic, partition, offset = self._published(m)
        return f"{topic}/{partition}/{offset}"

    def _dead(self, m: Input, reason: str) -> RejectedEvent:
        """The message's dead letter, naming where it was published (a copy's: the input's)."""
        key, topic, _, _ = self._published(m)
        dead = rejected(m.value if m.value is not None else b"", reason, topic, node=WORKER_NODE, key=key)
        ts = letter_ts(m.timestamp)
        if ts is not None:
            dead = dead.replace(ts=ts)
        return dead

    def _letter(self, m: Input, why: str) -> RejectedEvent:
        """The dead letter of a message that parsed but was not processed: `<table>: <why>`."""
        return self._dead(m, f"{self.input_type(m.topic).table}: {why}")

    def _apply(self, state: RunState, items: list[_Item], now: float) -> tuple[RunState, list[Output], list[_Item]]:
        """The pure core over one run's items; (state, outputs, dead letters that belong to another run)."""
        cfg = self.config.for_run(state.run_id)
        outputs: list[Output] = []
        elsewhere: list[_Item] = []
        for item in items:
            try:
                state, out = self._step(state, item, now, cfg)
            except Exception as exc:  # a bug must not stop the worker: keep the message, say why
                self.stats["errors"] += 1
                m = item.message
                log.exception("streams: failed to process %s/%s/%s", m.topic, m.partition, m.offset)
                dead = _Item(m, self._letter(m, f"not processed (worker error {type(exc).__name__}: {exc})"))
                if dead.event.run_id != state.run_id:
                    elsewhere.append(dead)
                    continue
                state, out = self._step(state, dead, now, cfg)
            outputs.extend(out)
        return state, outputs, elsewhere

    def _step(self, state: RunState, item: _Item, now: float, cfg: Any) -> tuple[RunState, list[Output]]:
        ev = item.event
        if isinstance(ev, StepEvent):
            self.stats["steps"] += 1
            return on_step(state, ev, now, cfg)
        if isinstance(ev, RejectedEvent):
            self.stats["rejected"] += 1
            m = item.message
            return on_rejected(state, ev, self._position(m), now, cfg)
        if isinstance(ev, RunEvent):
            self.stats["runs"] += 1
            return on_run(state, ev, now, cfg)
        if isinstance(ev, CommandAckEvent):
            self.stats["acks"] = self.stats.get("acks", 0) + 1
            return on_command_ack(state, ev, now, cfg)
        assert isinstance(ev, EvalEvent)
        self.stats["evals"] += 1
        after, out = on_eval(state, ev, now, cfg)
        why = self.store.round_too_large(after, round_key(ev))
        if why is None:
            return after, out
        # a round too large to keep: the result is refused as it arrives, before anything it led to goes
        # out (the state as if it never came; its dead letter instead), however the results are batched
        m = item.message
        return self._step(state, _Item(m, self._letter(m, f"not processed: {why}")), now, cfg)

    async def _save(self, state: RunState, items: list[_Item]) -> None:
        on_a_tick_state = state.run_id in self._unsaved  # the batch ran on a tick's state never stored
        try:
            self.save(state)
            return
        except StateRecordTooLarge as exc:  # the input's doing (a vote round too large to keep), said as such
            why = f"not processed: {exc}"
            if not on_a_tick_state:  # (else the tick's own line says it, once in ten minutes)
                log.warning("streams: state of run %r not saved (%s); its %d message(s) again, one by one",
                            state.run_id, exc, len(items))
        except Exception as exc:  # noqa: BLE001 - e.g. a value the codec cannot write
            self.stats["errors"] += 1
            why = "not processed (worker error: its state could not be saved)"
            if not on_a_tick_state:
                log.error("streams: state of run %r not saved (%s: %s); its %d message(s) again, one by one",
                          state.run_id, type(exc).__name__, exc, len(items))
        self.store.states.pop(state.run_id, None)  # the table still has the state before the batch
        self._unsaved.discard(state.run_id)  # (marked once: the replay below cannot come back here for it)
        if len(items) > 1 or on_a_tick_state:  # again one by one, on the state the table holds
            if self.reroute is not None:  # the run's own partition first: one alone off it keeps no state
                home = self._home(state.run_id)
                items = sorted(items, key=lambda it: it.message.partition != home)
            for item in items:
                await self.on_batch([item.message])
            return
        for item in items:  # the one message whose state cannot be saved: its dead letter instead
            m = item.message
            dead = self._letter(m, why)
            state = self.load(dead.run_id, m.partition)
            new_state, outputs = on_rejected(state, dead, self._position(m), self.clock(),
                                             self.config.for_run(dead.run_id))
            await self.emit(outputs)
            if self._held_elsewhere(dead.run_id, [m.partition]):  # the letter's run is not this worker's
                self.stats["not_kept_elsewhere"] = self.stats.get("not_kept_elsewhere", 0) + 1
                continue
            try:
                self.save(new_state)
            except StateRecordTooLarge as exc:  # a state that cannot be kept whatever comes: its letter is out
                self.stats["errors"] += 1
                self.store.states.pop(new_state.run_id, None)
                log.error("streams: state of run %r cannot be saved (%s); the dead letter's memory is not kept",
                          new_state.run_id, exc)

    # ---------------------------------------------------------------- clock

    async def on_tick(self, partition: int) -> None:
        """The clock for the runs that live on `partition`. Never raises: a run whose tick
        fails is logged and counted, and the other runs still get theirs."""
        self.stats["ticks"] += 1
        now = self.clock()
        outputs: list[Output] = []
        changed: list[RunState] = []
        for run_id in self.store.run_ids():
            try:
                state = self.load(run_id, partition)
                if run_id not in self._seen:  # first seen since a start or a rebalance: its input counts from now
                    self._touch(run_id, now, state)
                cfg = self.config.for_run(run_id)
                if state.partition != partition or not has_clock_work(state, now, cfg):
                    continue
                state, out = on_tick(state, now, cfg)
                outputs.extend(out)
                changed.append(state)
            except Exception:  # noqa: BLE001 - one run's bad state must not stop the clock
                self.stats["errors"] += 1
                log.exception("streams: tick of run %r failed", run_id)
        await self.emit(outputs)
        for state in changed:
            try:
                self.save(state)
            except Exception as exc:  # noqa: BLE001 - e.g. a head grown past a bound lowered under it
                # Its decisions are out: the state stays in memory, or each tick would make them again
                # and send them again (an alert a second). Its next save writes it whole; a restart
                # reads the one stored before. Said once in ten minutes a run, not at every tick.
                self.stats["errors"] += 1
                self.store.states[state.run_id] = state
                self.store.forget_saved(state.run_id)
                self._unsaved.add(state.run_id)
                said = self._unsaved_said.get(state.run_id)
                if said is None or now - said >= 600:
                    if len(self._unsaved_said) >= 1 << 16:
                        self._unsaved_said.clear()
                    self._unsaved_said[state.run_id] = now
                    log.error("streams: state of run %r not saved after its tick (%s: %s); kept in memory, and "
                              "a restart reads the one stored before it", state.run_id, type(exc).__name__, exc)
        await self.dead_letter_bad_states(partition)
        self.evict_idle(now)
        self.evict_over_cap()
        try:
            await self.send_changelog()
        except RecordRefused:  # no input of a tick to dead-letter: restarting would refuse it again, for ever
            self.stats["errors"] += 1
            log.exception("streams: the broker refused a state record of a tick (partition %d); the state stays "
                          "in memory, and a restart reads the one stored before it", partition)

    async def dead_letter_bad_states(self, partition: int) -> None:
        """Each stored state that did not decode: once to the dead-letter topic, then replaced."""
        while self.store.bad:
            bad = self.store.bad.pop(0)
            dead = rejected(bad.raw, f"stream state of run {bad.run_id!r}: {bad.why}", self.table_topic(),
                            node=WORKER_NODE, key=bad.run_id.encode())
            dead = dead.replace(event_id=derived_id("bad_state", bad.run_id, hashlib.sha256(bad.raw).hexdigest()))
            await self.emit([Output(dead)])
            if bad.run_id not in self.cache:  # else an input already replaced the records
                where = self._new_state_partition(bad.run_id, partition)
                self.save(RunState(bad.run_id, partition=self._bad_partition.pop(bad.run_id, where)))

    def table_topic(self) -> str:
        return getattr(self.table, "changelog_topic_name", None) or "streams-state"
