"""areal_metrics.streams.shell.batcher: messages in, batches through the core in arrival order, then acknowledged."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from areal_metrics.streams.shell.batch import Input
from areal_metrics.streams.shell.batcher import Batcher, Tick


class FakeCore:
    """Records what the batcher hands over (only on_batch and on_tick are used)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    async def on_batch(self, messages: list[Input]) -> None:
        self.calls.append(("batch", [m.offset for m in messages]))

    async def on_tick(self, partition: int) -> None:
        self.calls.append(("tick", partition))


def test_a_fetch_goes_through_in_order_with_ticks_in_place_and_is_acked_once_processed() -> None:
    async def go() -> tuple[list[tuple[str, Any]], list[list[Any]]]:
        core = FakeCore()
        acks: list[list[Any]] = []

        async def ack(tokens: list[Any]) -> None:
            assert core.calls, "acknowledged before it was processed"
            acks.append(list(tokens))

        batcher = Batcher(core, ack, max_batch=100, linger_s=0.01)  # type: ignore[arg-type]
        fetch = [(Input("steps", 0, o, b"r", b"{}"), f"m{o}") for o in range(3)]
        await batcher.add_many(fetch)
        await batcher.add(Tick(0), "t0")
        await batcher.add_many([(Input("steps", 0, 3, b"r", b"{}"), "m3")])
        await batcher.add_many([])
        await batcher.settled()
        return core.calls, acks

    calls, acks = asyncio.run(go())
    assert calls == [("batch", [0, 1, 2]), ("tick", 0), ("batch", [3])]
    assert acks == [["m0", "m1", "m2", "t0", "m3"]]  # one call per batch, in arrival order


def test_after_a_crash_the_batch_in_flight_goes_one_by_one_and_a_poison_message_is_not_processed(tmp_path) -> None:
    """The worker's crash guard (producers/runtime/poison.py) in the batcher: the positions of a
    batch are recorded while it is processed; after a crash on offsets 1-3 each goes alone, and
    offset 2, in flight in two crashes, goes to `on_poison` instead of the core's rules."""
    from areal_metrics.producers.runtime.poison import CrashGuard

    class GuardedCore(FakeCore):
        async def on_batch(self, messages: list[Input]) -> None:
            assert (tmp_path / "inflight.json").read_bytes()  # recorded while processed
            await super().on_batch(messages)

        async def on_poison(self, m: Input, crashes: int) -> None:
            self.calls.append(("poison", (m.offset, crashes)))

    crashed = CrashGuard(tmp_path)
    crashed.start()
    crashed.begin([("steps", 0, 1, 3)])  # the first process died here
    again = CrashGuard(tmp_path)
    again.start()
    again.begin([("steps", 0, 2, 2)])  # the second, on offset 2 alone

    async def go() -> list[tuple[str, Any]]:
        core = GuardedCore()
        guard = CrashGuard(tmp_path, limit=2)
        guard.start()

        async def ack(tokens: list[Any]) -> None:
            pass

        batcher = Batcher(core, ack, max_batch=100, linger_s=0.01, guard=guard)  # type: ignore[arg-type]
        await batcher.add_many([(Input("steps", 0, o, b"r", b"{}"), o) for o in range(6)])
        await batcher.settled()
        assert json.loads((tmp_path / "inflight.json").read_bytes()) == [] and guard.suspects == ()  # all processed: forgotten
        return core.calls

    assert asyncio.run(go()) == [("batch", [0]), ("batch", [1]), ("poison", (2, 2)), ("batch", [3]),
                                 ("batch", [4, 5])]


def _run_with_changelog_failing(tmp_path, failure: BaseException) -> tuple[list[Any], list[BaseException]]:
    """The real core whose changelog delivery raises `failure`, in a guarded batcher: (acks, crashes)."""
    from areal_metrics.producers.contract.events import StepEvent
    from areal_metrics.producers.contract.topics import Topics
    from areal_metrics.producers.runtime.poison import CrashGuard
    from areal_metrics.streams.core.config import StreamsConfig
    from areal_metrics.streams.shell.batch import StreamCore

    class FaustLikeTable:  # what the state store takes for Faust's table: its records go to `changelog`
        def __init__(self) -> None:
            self.data: dict[bytes, bytes] = {}

        def send_changelog(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("the worker sends its changelog itself")

    topics = Topics("areal.")

    async def go() -> tuple[list[Any], list[BaseException]]:
        async def send(topic: str, key: bytes, value: bytes):  # outputs: delivered
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

        async def changelog(records: list) -> None:
            raise failure

        core = StreamCore(topics=topics, config=StreamsConfig(), table=FaustLikeTable(), send=send,
                          changelog=changelog)
        acks: list[Any] = []

        async def ack(tokens: list[Any]) -> None:
            acks.extend(tokens)

        crashed: list[BaseException] = []
        guard = CrashGuard(tmp_path, limit=2)
        guard.start()
        batcher = Batcher(core, ack, max_batch=100, linger_s=0.01, guard=guard, on_crash=crashed.append)  # type: ignore[arg-type]
        step = StepEvent(run_id="r1", node="n0", step=1, epoch=0, reward=0.5, ts=1.0).to_json()
        await batcher.add_many([(Input(topics.steps, 0, 7, b"r1", step, 1.0), "m7")])
        for _ in range(100):
            if crashed:
                break
            await asyncio.sleep(0.01)
        return acks, crashed

    return asyncio.run(go())


def test_a_state_record_the_broker_refuses_stops_the_batch_and_leaves_it_in_flight_for_the_crash_guard(tmp_path) -> None:
    """`record_batches.deliver` raises RecordRefused (a state record over the topic's max.message.bytes): the
    batch is not acknowledged, the batcher calls on_crash, and the crash guard keeps the batch's positions
    in flight, so the restarted worker takes it apart and dead-letters the message that keeps failing."""
    from areal_metrics.producers.runtime.poison import CrashGuard
    from areal_metrics.streams.shell.record_batches import RecordRefused

    acks, crashed = _run_with_changelog_failing(tmp_path, RecordRefused("MessageSizeTooLargeError"))
    assert acks == [] and len(crashed) == 1 and isinstance(crashed[0], RecordRefused)
    assert CrashGuard(tmp_path, limit=2).start() == [("areal.steps", 0, 7, 7)]  # in flight at the next start


def test_a_delivery_the_broker_failed_stops_the_worker_without_blaming_the_batch(tmp_path) -> None:
    """A broker away past the producer's timeout is no message's fault: a flapping broker must not make two
    crashes of a healthy message and dead-letter it. The batch is not acknowledged, so it is read again."""
    from areal_metrics.producers.runtime.poison import CrashGuard
    from areal_metrics.streams.shell.record_batches import DeliveryFailed

    acks, crashed = _run_with_changelog_failing(tmp_path, DeliveryFailed("KafkaTimeoutError"))
    assert acks == [] and len(crashed) == 1 and isinstance(crashed[0], DeliveryFailed)
    assert CrashGuard(tmp_path, limit=2).start() == []  # nothing in flight counts against the batch


def test_a_state_record_of_a_tick_the_broker_refuses_is_logged_not_a_crash_loop() -> None:
    """A tick has no input to dead-letter: a crash would refuse the same record again at every restart."""
    from areal_metrics.producers.contract.topics import Topics
    from areal_metrics.streams.core.config import StreamsConfig
    from areal_metrics.streams.shell.batch import StreamCore
    from areal_metrics.streams.shell.record_batches import RecordRefused

    async def go() -> dict[str, int]:
        async def send(topic: str, key: bytes, value: bytes):
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

        async def changelog(records: list) -> None:
            raise RecordRefused("MessageSizeTooLargeError")

        core = StreamCore(topics=Topics("areal."), config=StreamsConfig(), table={}, send=send, changelog=changelog)
        core.store.io.outbox = [(0, b"r1", b"x")]  # a record the tick wrote
        await core.on_tick(0)
        return core.stats

    assert asyncio.run(go())["errors"] == 1


def test_an_alert_the_broker_never_took_stops_the_worker_without_blaming_the_batch(tmp_path) -> None:
    """emit waits for the outputs that must be delivered (alerts, commands) before the changelog: their
    failure is classified as the changelog's is (`record_batches.settled`), or a broker away past the
    producer's timeout made the guard blame the batch, and two such flaps dead-lettered a healthy step."""
    from aiokafka.errors import KafkaTimeoutError

    from areal_metrics.producers.contract.events import StepEvent
    from areal_metrics.producers.contract.topics import Topics
    from areal_metrics.producers.runtime.poison import CrashGuard
    from areal_metrics.streams.core.config import RunConfig, StreamsConfig
    from areal_metrics.streams.shell.batch import StreamCore
    from areal_metrics.streams.shell.record_batches import DeliveryFailed

    topics = Topics("areal.")
    broker_away = {"now": False}

    async def go() -> tuple[list[Any], list[BaseException]]:
        async def send(topic: str, key: bytes, value: bytes):
            done = asyncio.get_running_loop().create_future()
            if broker_away["now"]:
                done.set_exception(KafkaTimeoutError())  # a batch expired in aiokafka's accumulator
            else:
                done.set_result(None)
            return done

        async def changelog(records: list) -> None:
            pass

        config = StreamsConfig(defaults=RunConfig(window=2, reward_threshold=0.5))
        core = StreamCore(topics=topics, config=config, table={}, send=send, changelog=changelog)
        acks: list[Any] = []
        crashed: list[BaseException] = []

        async def ack(tokens: list[Any]) -> None:
            acks.extend(tokens)

        guard = CrashGuard(tmp_path, limit=2)
        guard.start()
        batcher = Batcher(core, ack, max_batch=1, linger_s=0.0, guard=guard, on_crash=crashed.append)  # type: ignore[arg-type]
        for i, reward in enumerate([0.9, 0.9, 0.9, 0.1, 0.1, 0.1]):  # the low rewards raise an alert
            broker_away["now"] = i >= 3
            step = StepEvent(run_id="r1", node="n0", step=i + 1, epoch=0, reward=reward, ts=1.0 + i).to_json()
            await batcher.add_many([(Input(topics.steps, 0, i, b"r1", step, 1.0 + i), f"m{i}")])
            for _ in range(50):
                if crashed or len(acks) > i:
                    break
                await asyncio.sleep(0.01)
            if crashed:
                break
        return acks, crashed

    acks, crashed = asyncio.run(go())
    assert len(crashed) == 1 and isinstance(crashed[0], DeliveryFailed) and acks == ["m0", "m1", "m2"]
    assert CrashGuard(tmp_path, limit=2).start() == []  # the step in flight is not blamed


def test_after_a_crash_no_batch_runs_so_the_crashed_batch_stays_in_flight(tmp_path) -> None:
    """A batch begun after a crash (while the process stops) wrote over the crashed batch's positions in
    flight and its end cleared them: the crash counted against no message, and a poison one looped."""
    from areal_metrics.producers.runtime.poison import CrashGuard

    class CrashesOnce(FakeCore):
        async def on_batch(self, messages: list[Input]) -> None:
            await super().on_batch(messages)
            if messages[0].offset == 1:
                raise RuntimeError("a rule's bug")

    async def go() -> tuple[FakeCore, list[Any], list[BaseException]]:
        core, acks, crashed = CrashesOnce(), [], []

        async def ack(tokens: list[Any]) -> None:
            acks.extend(tokens)

        guard = CrashGuard(tmp_path, limit=2)
        guard.start()
        batcher = Batcher(core, ack, max_batch=100, linger_s=0.0, guard=guard, on_crash=crashed.append)  # type: ignore[arg-type]
        await batcher.add_many([(Input("steps", 0, 1, b"r", b"{}"), "m1")])
        for _ in range(50):
            if crashed:
                break
            await asyncio.sleep(0.01)
        await batcher.add_many([(Input("steps", 0, 2, b"r", b"{}"), "m2")])  # arrives while the process stops
        await asyncio.sleep(0.1)
        return core, acks, crashed

    core, acks, crashed = asyncio.run(go())
    assert len(crashed) == 1 and acks == [] and core.calls == [("batch", [1])]
    assert CrashGuard(tmp_path, limit=2).start() == [("steps", 0, 1, 1)]
