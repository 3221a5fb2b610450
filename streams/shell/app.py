"""The Faust shell: bytes in, batches through the core (areal_metrics.streams.shell.batch), bytes out.

Four inputs, `steps` (areal.steps), `evals` (areal.evals), `acks` (areal.acks: trainers' command
acknowledgements) and `runs` (areal.runs: run
lifecycle), reach the worker a fetch at a time (areal_metrics.streams.shell.faust_internals: Faust's consumer
without its per-message path); one agent, `ticks`, reads an internal topic a timer writes
to, one tick per partition, so clock-driven decisions (steps whose ranks did not all come,
stalled runs, vote timeouts) keep their place among the inputs. Everything goes to one
Batcher (areal_metrics.streams.shell.batcher), whose single flusher runs the batches through StreamCore in
arrival order and acknowledges the messages afterwards.

State: one Faust table `runs` whose changelog topic holds each run's state as small
records (areal_metrics.streams.state.state_store), so a restarted worker picks up windows, vote rounds and
cooldowns where they were. Messages carry the contract's JSON (raw bytes, key = run_id),
not Faust records. A run's state lives on the partition its run_id key maps to; a message read
on another one (not keyed by its run_id) is sent on to that partition of the input's repartition
topic (`repartition_topic_for`), read like the inputs, so several workers never each keep a
state of one run.

Order of effects per batch, for "neither repeat nor lose an output" across a crash:
outputs that must exist once (consensus, commands, alerts) are sent and their delivery
awaited BEFORE the new state is written to the table, and the input offsets are
committed only after that (Faust flushes the producer before it commits); if the worker
dies in between, the batch is processed again from the old state and produces the same
events with the same event_ids.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import faust

from areal_metrics.producers.contract.limits import StructureLimits
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.producers.runtime.poison import CrashGuard
from areal_metrics.streams.shell.batch import Input, SendFn, StreamCore
from areal_metrics.streams.shell.faust_internals import BatchApp, transport_producer
from areal_metrics.streams.shell.batcher import Batcher, Tick
from areal_metrics.streams.core.config import StreamsConfig
from areal_metrics.streams.shell.input_feed import InputFeed
from areal_metrics.streams.shell.kafka_admin import repartition_max_bytes, repartition_spec
from areal_metrics.streams.shell.record_batches import Message, deliver, send_in_batches
from areal_metrics.streams.shell.resync import InputGuard
from areal_metrics.streams.shell.settings import WorkerSettings

__all__ = ["Input", "KafkaTransport", "SendFn", "StreamCore", "StreamWorker", "Transport", "app_id_for", "build_worker",
           "ticks_topic_for"]

log = logging.getLogger("streams")


def broker_credentials(settings: Any) -> Any:
    """Faust credentials from areal_metrics.producers.contract.settings.Settings (None for PLAINTEXT)."""
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
        from areal_metrics.producers.contract.settings import quiet_client_debug_logs

        quiet_client_debug_logs()  # client DEBUG logs would show the handshake's password
        return faust.SASLCredentials(
            username=settings.kafka_sasl_username,
            password=settings.kafka_sasl_password,
            mechanism=(settings.kafka_sasl_mechanism or "PLAIN").upper(),  # Faust's enum: Kafka's spelling
            ssl_context=context,
        )
    return faust.SSLCredentials(context)


def app_id_for(prefix: str) -> str:
    """The Faust app id (consumer group, changelog names) of a topic prefix."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", prefix).strip("._-") or "default"
    return f"areal-streams-{cleaned}"


def ticks_topic_for(prefix: str) -> str:
    return f"{app_id_for(prefix)}-ticks"


def repartition_topic_for(prefix: str, topic: str) -> str:
    """The worker's own topic for the messages of input `topic` read off their run's partition, sent on to
    it (a run's state lives where its run_id key maps: streams/shell/batch.py `reroute`)."""
    name = topic[len(prefix):] if topic.startswith(prefix) else topic
    return f"{app_id_for(prefix)}-{name}-repartition"


@dataclass
class StreamWorker:
    """The Faust app with its inputs, agent, table and timers, built for one topic prefix."""

    app: faust.App
    core: StreamCore
    batcher: Batcher
    feed: InputFeed  # the input topics' messages, a fetch at a time
    ticks_agent: Any
    partitions: int

    async def settled(self) -> None:
        """Returns once every message the agents received so far is processed (tests)."""
        await self.batcher.settled()


def _faust_app(prefix: str, bootstrap: str, credentials: Any, datadir: Path, partitions: int,
               replication_factor: int, commit_interval: float, session_timeout: float) -> faust.App:
    return BatchApp(
        app_id_for(prefix),
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
        # A batch's outputs and state records leave in a few produce requests, not one each
        # (the batch waits for their acknowledgement anyway).
        producer_linger=0.005,
        producer_max_batch_size=256 * 1024,
        worker_redirect_stdouts=False,
    )


class Transport(Protocol):
    """How the worker's records leave and its inputs are acknowledged: build_worker's one seam.

    `KafkaTransport` is the worker's; a test passes a fake that records the outputs and has no
    consumer to acknowledge to (tests/feed_support.py: `RecordingTransport`)."""

    # Does it send inputs off their run's partition on to the run's (StreamCore `reroute`)? A fake
    # whose outputs never reach a broker cannot: the copies would not come back
    reroutes: bool

    def outputs(self, app: faust.App, runs: Any) -> dict[str, Any]:
        """StreamCore's output arguments: `send_many` and `changelog`, or `send`."""

    def input_guard(self) -> InputGuard | None:
        """The consumer's skipped-input guard (areal_metrics.streams.shell.resync); None without a consumer."""

    def ack_inputs(self, app: faust.App, inputs: list[Any]) -> None:
        """The input messages of a processed batch: their offsets may be committed."""

    def batcher_hooks(self, app: faust.App, feed: InputFeed) -> dict[str, Any]:
        """The Batcher's `backlog` and `on_crash`, where there is a consumer to ask and a worker to stop."""


class KafkaTransport:
    """Outputs and the table's changelog straight to the transport producer, as record batches (our values
    are bytes already, and Faust's Topic.send or Table.send_changelog bookkeeping costs about as much as
    the rest of a step's work); the commit flushes the producer before it commits the inputs' offsets.
    The changelog's batches are waited for (`deliver`): a state record the broker refuses stops the batch.
    `changelog_max_bytes`: the changelog's record batches are cut at it (the topic's max.message.bytes
    bounds a whole batch; None: at the producer's batch size, 256 KiB)."""

    reroutes = True
    # outputs and copies sent on: record batches within Kafka's default max.message.bytes (1,048,588), which
    # the output topics have, and under every repartition topic's limit (kafka_admin.repartition_max_bytes)
    OUTPUT_BATCH_BYTES = 1_000_000

    def __init__(self, changelog_max_bytes: int | None = None) -> None:
        self.changelog_max_bytes = changelog_max_bytes

    def outputs(self, app: faust.App, runs: Any) -> dict[str, Any]:
        async def send_many(messages: Sequence[Message]) -> list[Awaitable[Any]]:
            return await send_in_batches(transport_producer(app), messages, self.OUTPUT_BATCH_BYTES)

        async def changelog(records: list[tuple[int, bytes, bytes | None]]) -> None:
            topic = runs.changelog_topic_name  # a Faust property that builds the name: once a call, not once a record
            await deliver(transport_producer(app), [(topic, partition, key, value) for partition, key, value in records],
                          self.changelog_max_bytes)

        return {"send_many": send_many, "changelog": changelog}

    def input_guard(self) -> InputGuard | None:
        return InputGuard()

    def ack_inputs(self, app: faust.App, inputs: list[Any]) -> None:
        app.consumer.ack_all(inputs)

    def batcher_hooks(self, app: faust.App, feed: InputFeed) -> dict[str, Any]:
        return {"backlog": feed.backlog, "on_crash": lambda exc: app.loop.create_task(app.crash(exc))}


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
    transport: Transport | None = None,
    credentials: Any = None,
    replication_factor: int = 1,
    min_insync_replicas: int = 1,
    max_batch: int = 2000,
    linger_s: float | None = None,
    guard: CrashGuard | None = None,
    crash_marker: bytes | None = None,
    run_limits: tuple[float, float, int] | None = None,
    state_record_max_bytes: int | None = None,
    repartition_bytes: int | None = None,
) -> StreamWorker:
    """A Faust app for this prefix. `transport` (KafkaTransport by default) is where records go.

    `replication_factor` and `min_insync_replicas` apply to the topics Faust creates: the table's
    changelog (the worker's durable state) and its ticks topic. A batch is at most `max_batch`
    messages and waits at most `linger_s` for more (the entry point passes AREAL_STREAMS_LINGER_MS).
    `guard` skips a message that crashed the worker (producers/runtime/poison.py); `crash_marker`
    is its test hook (AREAL_TEST_CRASH_ON). `run_limits`: (run idle s, ended run idle s, max runs) of
    the live run state (AREAL_WORKER_RUN_IDLE_S, _ENDED_RUN_IDLE_S, _MAX_RUNS; None: their defaults).
    `state_record_max_bytes`: the largest state record (None: AREAL_WORKER_STATE_RECORD_MAX_BYTES); the
    changelog Faust would make takes it (the entry point makes the changelog first: kafka_admin).
    `repartition_bytes`: the largest copy the repartition topics take (None: from the defaults).
    """
    if state_record_max_bytes is None:
        state_record_max_bytes = WorkerSettings().worker_state_record_max_bytes
    if repartition_bytes is None:
        repartition_bytes = repartition_max_bytes(state_record_max_bytes, StructureLimits().max_bytes)
    config, transport = config or StreamsConfig(), transport or KafkaTransport(state_record_max_bytes)
    app = _faust_app(topics.prefix, bootstrap, credentials, datadir, partitions, replication_factor,
                     commit_interval, session_timeout)
    durability = {"min.insync.replicas": str(min_insync_replicas)}
    raw = (topics.steps, topics.evals, topics.runs, topics.acks)
    reroute = {name: repartition_topic_for(topics.prefix, name) for name in raw} if transport.reroutes else {}
    inputs = (*raw, *reroute.values())
    input_topics = [app.topic(name, key_type=bytes, value_type=bytes) for name in raw]
    input_topics += [app.topic(name, key_type=bytes, value_type=bytes, partitions=partitions, replicas=replication_factor,
                               config={**durability, **repartition_spec(name, None, repartition_bytes).config})
                     for name in reroute.values()]
    ticks = app.topic(ticks_topic_for(topics.prefix), key_type=bytes, value_type=bytes, partitions=partitions,
                      replicas=replication_factor, config=durability)
    runs = app.Table("runs", partitions=partitions, key_type=bytes, value_type=bytes, default=None,
                     extra_topic_configs={**durability, "max.message.bytes": str(state_record_max_bytes)},
                     help="per-run state of the stream worker (areal_metrics.streams.state.state_store records)")
    idle, ended_idle, max_runs = run_limits or (None, None, None)
    core = StreamCore(topics=topics, config=config, table=runs, clock=clock, run_idle_s=idle,
                      ended_run_idle_s=ended_idle, max_runs=max_runs, state_record_max_bytes=state_record_max_bytes,
                      reroute=reroute or None, partitions=partitions, reroute_max_bytes=repartition_bytes,
                      **transport.outputs(app, runs))

    @runs.on_recover
    async def reindex() -> None:
        # Recovery restored the records of partitions this worker got, and Faust dropped those of
        # partitions it lost: the store's index of records by run is read from the table again.
        core.forget_cache()

    feed = InputFeed(app, transport.input_guard(), inputs)
    for topic in input_topics:
        app.topics.add(topic)  # subscribed (and so co-partitioned with the table), read by the feed
    app.batch_inputs = (frozenset(feed.inputs), feed.deliver)

    async def ack(tokens: list[Any]) -> None:
        for token in tokens:
            if isinstance(token, tuple):  # a tick, through its agent's stream
                await token[0].ack(token[1])
        transport.ack_inputs(app, [token for token in tokens if not isinstance(token, tuple)])

    if linger_s is None:  # the setting's default
        linger_s = WorkerSettings().streams_linger_ms / 1000.0
    batcher = feed.batcher = Batcher(core, ack, max_batch=max_batch, linger_s=max(0.0, linger_s), guard=guard,
                                     crash_marker=crash_marker, **transport.batcher_hooks(app, feed))
    ticks_agent = _schedule(app, ticks, core, batcher, feed, clock, partitions, config.tick_interval_s)
    return StreamWorker(app=app, core=core, batcher=batcher, feed=feed, ticks_agent=ticks_agent,
                        partitions=partitions)


def _schedule(app: faust.App, ticks: Any, core: StreamCore, batcher: Batcher, feed: InputFeed,
              clock: Callable[[], float], partitions: int, tick_interval_s: float) -> Any:
    """The worker's agent (ticks), its timers and its rebalance hook; the ticks agent."""

    @app.agent(ticks, name="ticks")
    async def ticks_agent(stream: Any) -> None:
        stream = stream.noack()
        async for event in stream.events():
            await batcher.add(Tick(event.message.partition), (stream, event))

    @app.timer(interval=tick_interval_s)
    async def clock_tick() -> None:
        body = json.dumps({"now": clock()}).encode()
        for p in range(partitions):
            await ticks.send(key=None, value=body, partition=p, force=True)

    @app.timer(interval=5.0)
    async def unstick_inputs() -> None:
        await feed.unstick()

    @app.on_partitions_revoked.connect
    async def drop_cache(app: faust.App, revoked: Any, **kwargs: Any) -> None:
        # Another worker may own these runs next: their cached state would go stale.
        core.forget_cache()
        feed.forget()

    # Table writes queue changelog records in Faust's producer buffer; the default of 100
    # makes the stream stop and drain (with a warning) every 100 records under load.
    app.producer.buffer.max_messages = 2000
    return ticks_agent
