"""The Faust shell: bytes in, the pure core (streams.processor), bytes out.

Four agents, one per input: `steps` (areal.steps), `evals` (areal.evals), `runs`
(areal.runs: run lifecycle) and `ticks` (an internal topic a timer writes to, one tick per
partition, so clock-driven decisions (steps whose ranks did not all come, stalled runs,
vote timeouts) happen inside a stream, where Faust lets them change tables).

State: one Faust table `runs` (run_id -> RunState JSON) with a changelog topic, so a
restarted worker picks up windows, vote rounds and cooldowns where they were. Messages
carry the contract's JSON (raw bytes, key = run_id), not Faust records.

Order of effects per input, for "neither repeat nor lose an output" across a crash:
outputs that must exist once (consensus, commands, alerts) are sent and their delivery
awaited BEFORE the new state is written to the table; if the worker dies in between, the
input is processed again from the old state and produces the same events with the same
event_ids. A per-run lock keeps the agents from interleaving on one run's state.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import faust
from faust.types import TP

from producers.deadletter import rejected
from producers.events import (
    EvalEvent,
    Event,
    RunEvent,
    StepEvent,
    ValidationError,
    parse_event,
)
from producers.topics import Topics
from streams.codec import StateDecodeError
from streams.config import StreamsConfig
from streams.processor import (
    WORKER_NODE,
    Output,
    RunState,
    derived_id,
    has_clock_work,
    on_eval,
    on_rejected,
    on_run,
    on_step,
    on_tick,
)
from streams.resync import InputGuard

log = logging.getLogger("streams")

# Sends one message; returns an awaitable that completes when the broker has it.
SendFn = Callable[[str, bytes, bytes], Awaitable[Awaitable[Any]]]


def broker_credentials(settings: Any) -> Any:
    """Faust credentials from producers.settings.Settings (None for PLAINTEXT)."""
    import ssl

    protocol = (getattr(settings, "kafka_security_protocol", "PLAINTEXT") or "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return None
    context = None
    if protocol in ("SSL", "SASL_SSL"):
        context = ssl.create_default_context(cafile=settings.kafka_ssl_cafile)
        if settings.kafka_ssl_certfile:
            context.load_cert_chain(settings.kafka_ssl_certfile, settings.kafka_ssl_keyfile)
    if protocol.startswith("SASL"):
        from producers.settings import quiet_client_debug_logs

        quiet_client_debug_logs()  # client DEBUG logs would show the handshake's password
        return faust.SASLCredentials(
            username=settings.kafka_sasl_username,
            password=settings.kafka_sasl_password,
            mechanism=settings.kafka_sasl_mechanism or "PLAIN",
            ssl_context=context,
        )
    return faust.SSLCredentials(context)


def app_id_for(prefix: str) -> str:
    """The Faust app id (consumer group, changelog names) of a topic prefix."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", prefix).strip("._-") or "default"
    return f"areal-streams-{cleaned}"


def ticks_topic_for(prefix: str) -> str:
    return f"{app_id_for(prefix)}-ticks"


@dataclass
class StreamCore:
    """The per-message logic of the shell, without Faust: load state, call the core, send, save.

    `table` is any mutable mapping bytes -> bytes (the Faust table in the worker), `send`
    publishes one message. Kept apart from Faust so it is easy to read and to test.
    """

    topics: Topics
    config: StreamsConfig
    table: Any
    send: SendFn
    clock: Callable[[], float] = time.time
    cache: dict[str, RunState] = field(default_factory=dict)  # decoded states, write-through
    bad_states: list[tuple[str, bytes, str]] = field(default_factory=list)  # (run_id, record, why): to dead-letter
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    # Skipped-input guard (streams.resync); `seek(topic, partition, offset)` is the shell's.
    guard: InputGuard | None = None
    seek: Callable[[str, int, int], Awaitable[None]] | None = None
    stats: dict[str, int] = field(default_factory=lambda: {"steps": 0, "evals": 0, "runs": 0, "rejected": 0,
                                                            "ticks": 0, "outputs": 0, "errors": 0})

    # ---------------------------------------------------------------- state

    def load(self, run_id: str, partition: int) -> RunState:
        state = self.cache.get(run_id)
        if state is None:
            raw = self.table.get(run_id.encode())
            state = self._decode(run_id, raw) if raw is not None else None
            if state is None:
                state = RunState(run_id, partition=partition)
        if state.partition is None:
            state = replace(state, partition=partition)
        return state

    def _decode(self, run_id: str, raw: Any) -> RunState | None:
        """A stored record that does not decode (corrupt, foreign, another version): None.

        The run starts over from an empty state and the record is kept in `bad_states`
        (and logged) until the shell dead-letters it: a bad record must never make every
        later input or tick of the run raise.
        """
        try:
            state = RunState.from_json(raw)
            if state.run_id != run_id:
                raise StateDecodeError(f"stream state $.run_id: {state.run_id!r} stored under {run_id!r}")
            return state
        except (StateDecodeError, TypeError) as exc:
            self.stats["bad_states"] = self.stats.get("bad_states", 0) + 1
            log.error("streams: stored state of run %r does not decode (%s); starting it over", run_id, exc)
            self.bad_states.append((run_id, bytes(raw) if isinstance(raw, (bytes, bytearray)) else str(raw).encode(),
                                    str(exc)))
            return None

    def save(self, state: RunState) -> None:
        self.cache[state.run_id] = state
        self.table[state.run_id.encode()] = state.to_json()

    def forget_cache(self) -> None:
        self.cache.clear()

    def lock(self, run_id: str) -> asyncio.Lock:
        found = self.locks.get(run_id)
        if found is None:
            found = self.locks[run_id] = asyncio.Lock()
        return found

    # ---------------------------------------------------------------- output

    async def emit(self, outputs: list[Output]) -> None:
        pending = []
        for out in outputs:
            ev = out.event
            delivered = await self.send(self.topics.for_event(ev), ev.run_id.encode(), ev.to_json())
            if out.must_ack:
                pending.append(delivered)
        self.stats["outputs"] += len(outputs)
        for fut in pending:
            await fut

    # ---------------------------------------------------------------- inputs

    async def on_input(
        self, topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
        timestamp: float | None = None,
    ) -> None:
        """One message from areal.steps, areal.evals or areal.runs. Never raises for bad input.

        `timestamp` (the Kafka message's) becomes the `ts` of a dead letter, so a
        redelivered bad message gives the very same dead letter.
        """
        if self.guard is not None:
            verdict, target = self.guard.on_message((topic, partition), offset, time.monotonic())
            if verdict == "drop":
                return
            if verdict == "seek":
                log.warning("%s/%s jumped to offset %s; re-reading from %s", topic, partition, offset, target)
                if self.seek is not None and target is not None:
                    await self.seek(topic, partition, target)
                return
        expected = self.input_type(topic)
        raw = value if value is not None else b""
        try:
            if value is None:
                raise ValidationError(expected.table, "empty message (null value)")
            event = parse_event(value, expected=expected)
        except ValidationError as err:
            await self.dead_letter(topic, partition, offset, key, raw, str(err), timestamp)
            return
        try:
            await self._process(event, partition)
            if self.bad_states:
                await self.dead_letter_bad_states(partition)
        except Exception as exc:  # a bug must not stop the worker: keep the message, say why
            self.stats["errors"] += 1
            log.exception("streams: failed to process %s/%s/%s", topic, partition, offset)
            await self.dead_letter(topic, partition, offset, key, raw,
                                   f"{expected.table}: not processed (worker error {type(exc).__name__}: {exc})",
                                   timestamp)

    def input_type(self, topic: str) -> type[Event]:
        """The event type an input topic carries (anything but steps and runs is read as evals)."""
        if topic == self.topics.steps:
            return StepEvent
        return RunEvent if topic == self.topics.runs else EvalEvent

    async def _process(self, event: Event, partition: int) -> None:
        async with self.lock(event.run_id):
            state = self.load(event.run_id, partition)
            cfg = self.config.for_run(event.run_id)
            now = self.clock()
            if isinstance(event, StepEvent):
                self.stats["steps"] += 1
                new_state, outputs = on_step(state, event, now, cfg)
            elif isinstance(event, RunEvent):
                self.stats["runs"] += 1
                new_state, outputs = on_run(state, event, now, cfg)
            else:
                assert isinstance(event, EvalEvent)
                self.stats["evals"] += 1
                new_state, outputs = on_eval(state, event, now, cfg)
            await self.emit(outputs)
            if new_state != state:
                self.save(new_state)

    async def dead_letter(
        self, topic: str, partition: int, offset: int, key: bytes | None, raw: bytes, reason: str,
        timestamp: float | None = None,
    ) -> None:
        self.stats["rejected"] += 1
        dead = rejected(raw, reason, topic, node=WORKER_NODE, key=key)
        if timestamp is not None and timestamp >= 0:
            dead = dead.replace(ts=timestamp)
        async with self.lock(dead.run_id):
            state = self.load(dead.run_id, partition)
            new_state, outputs = on_rejected(state, dead, f"{topic}/{partition}/{offset}", self.clock(),
                                             self.config.for_run(dead.run_id))
            await self.emit(outputs)
            self.save(new_state)

    async def on_tick(self, partition: int) -> None:
        """The clock for the runs that live on `partition`. Never raises: a run whose tick
        fails is logged and counted, and the other runs still get theirs."""
        self.stats["ticks"] += 1
        now = self.clock()
        for key in list(self.table.keys()):
            try:
                run_id = key.decode() if isinstance(key, (bytes, bytearray)) else str(key)
                await self._tick_run(run_id, partition, now)
            except Exception:
                self.stats["errors"] += 1
                log.exception("streams: tick of run %r failed", key)
        await self.dead_letter_bad_states(partition)

    async def _tick_run(self, run_id: str, partition: int, now: float) -> None:
        state = self.load(run_id, partition)
        if state.partition != partition:
            return
        cfg = self.config.for_run(run_id)
        if not has_clock_work(state, now, cfg):
            return
        async with self.lock(run_id):
            state = self.load(run_id, partition)
            new_state, outputs = on_tick(state, now, cfg)
            await self.emit(outputs)
            self.save(new_state)

    async def dead_letter_bad_states(self, partition: int) -> None:
        """Each stored state that did not decode: once to the dead-letter topic, then replaced."""
        while self.bad_states:
            run_id, raw, why = self.bad_states.pop(0)
            dead = rejected(raw, f"stream state of run {run_id!r}: {why}", self.table_topic(), node=WORKER_NODE,
                            key=run_id.encode())
            dead = dead.replace(event_id=derived_id("bad_state", run_id, hashlib.sha256(raw).hexdigest()))
            await self.emit([Output(dead)])
            async with self.lock(run_id):
                if run_id not in self.cache:  # else an input already replaced the record
                    self.save(RunState(run_id, partition=partition))

    def table_topic(self) -> str:
        return getattr(self.table, "changelog_topic_name", None) or "streams-state"


@dataclass
class StreamWorker:
    """The Faust app with its agents, table and timer, built for one topic prefix."""

    app: faust.App
    core: StreamCore
    steps_agent: Any
    evals_agent: Any
    runs_agent: Any
    ticks_agent: Any
    partitions: int


def build_worker(
    *,
    bootstrap: str,
    topics: Topics,
    datadir: Path,
    config: StreamsConfig | None = None,
    partitions: int = 3,
    clock: Callable[[], float] = time.time,
    commit_interval: float = 0.5,
    session_timeout: float = 10.0,
    send: SendFn | None = None,
    credentials: Any = None,
    replication_factor: int = 1,
    min_insync_replicas: int = 1,
) -> StreamWorker:
    """A Faust app for this prefix. `send` replaces the Kafka producer (agent tests).

    `replication_factor` and `min_insync_replicas` (Settings.kafka_replication_factor,
    kafka_min_insync_replicas) apply to the topics Faust creates: the table's changelog
    (the worker's durable state) and its ticks topic.
    """
    config = config or StreamsConfig()
    durability = {"min.insync.replicas": str(min_insync_replicas)}
    app = faust.App(
        app_id_for(topics.prefix),
        broker="kafka://" + ";".join(bootstrap.split(",")),
        broker_credentials=credentials,
        datadir=str(datadir),
        store="memory://",  # the changelog topic is the durable copy
        web_enabled=False,
        autodiscover=False,
        topic_partitions=partitions,
        topic_replication_factor=replication_factor,
        table_standby_replicas=0,
        key_serializer="raw",
        value_serializer="raw",
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=commit_interval,
        broker_session_timeout=session_timeout,
        broker_heartbeat_interval=1.0,
        broker_rebalance_timeout=session_timeout,
        producer_acks=-1,
        worker_redirect_stdouts=False,
    )
    steps = app.topic(topics.steps, key_type=bytes, value_type=bytes)
    evals = app.topic(topics.evals, key_type=bytes, value_type=bytes)
    run_events = app.topic(topics.runs, key_type=bytes, value_type=bytes)
    ticks = app.topic(ticks_topic_for(topics.prefix), key_type=bytes, value_type=bytes, partitions=partitions,
                      replicas=replication_factor, config=durability)
    runs = app.Table("runs", partitions=partitions, key_type=bytes, value_type=bytes, default=None,
                     extra_topic_configs=durability,
                     help="per-run state of the stream worker (streams.processor.RunState as JSON)")
    async def kafka_send(topic: str, key: bytes, value: bytes) -> Awaitable[Any]:
        # Straight to the transport producer: our values are bytes already, and Faust's
        # Topic.send bookkeeping costs about as much as the rest of a step's work.
        return await app.producer.send(topic, key, value, None, None, None)

    core = StreamCore(topics=topics, config=config, table=runs, send=send or kafka_send, clock=clock)
    if send is None:  # a real consumer: guard against skipped input (streams.resync)
        core.guard = InputGuard()

        async def seek(topic: str, partition: int, offset: int) -> None:
            await app.consumer.seek(TP(topic, partition), offset)

        core.seek = seek

    async def consume_inputs(stream: Any) -> None:
        async for event in stream.events():
            m = event.message
            await core.on_input(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp)

    @app.agent(steps, name="steps")
    async def steps_agent(stream: Any) -> None:
        await consume_inputs(stream)

    @app.agent(evals, name="evals")
    async def evals_agent(stream: Any) -> None:
        await consume_inputs(stream)

    @app.agent(run_events, name="runs")
    async def runs_agent(stream: Any) -> None:
        await consume_inputs(stream)

    @app.agent(ticks, name="ticks")
    async def ticks_agent(stream: Any) -> None:
        async for event in stream.events():
            await core.on_tick(event.message.partition)

    @app.timer(interval=config.tick_interval_s)
    async def clock_tick() -> None:
        body = json.dumps({"now": clock()}).encode()
        for p in range(partitions):
            await ticks.send(key=None, value=body, partition=p, force=True)

    @app.timer(interval=5.0)
    async def unstick_inputs() -> None:
        """Partitions whose fetched messages stopped coming: seek back (streams.resync)."""
        if core.guard is None or core.seek is None:
            return
        for tp in list(app.consumer.assignment()):
            if tp.topic not in (topics.steps, topics.evals, topics.runs):
                continue
            try:
                position = await app.consumer.position(tp)
            except Exception:  # noqa: BLE001 - a partition being reassigned: next time
                continue
            # Faust keeps a committed offset of 0 as None; the worker commits start offsets
            # for every partition before it starts, so None means 0 here.
            committed = getattr(app.consumer, "_committed_offset", {}).get(tp) or 0
            target = core.guard.stuck((tp.topic, tp.partition), position, time.monotonic(), committed)
            if target is not None:
                log.warning("%s/%s fetched up to %s but delivers nothing; re-reading from %s",
                            tp.topic, tp.partition, position, target)
                await core.seek(tp.topic, tp.partition, target)

    @app.on_partitions_revoked.connect
    async def drop_cache(app: faust.App, revoked: Any, **kwargs: Any) -> None:
        # Another worker may own these runs next: their cached state would go stale.
        core.forget_cache()
        if core.guard is not None:
            core.guard.forget()

    # Table writes queue changelog records in Faust's producer buffer; the default of 100
    # makes the stream stop and drain (with a warning) every 100 steps under load.
    app.producer.buffer.max_messages = 2000

    return StreamWorker(app=app, core=core, steps_agent=steps_agent, evals_agent=evals_agent,
                        runs_agent=runs_agent, ticks_agent=ticks_agent, partitions=partitions)
