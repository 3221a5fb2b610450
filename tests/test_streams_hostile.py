"""Hostile input for the stream worker's input and tick paths, across a restart (no broker).

`StreamCore` is the worker's per-message logic; here its table is a plain dict of bytes
(what the changelog holds) and `send` records what would go to Kafka. A "restart" is a
new StreamCore over the same table: every state is reloaded through the codec.

Properties, for any mix of good and bad messages (steps from several ranks, evals, run
lifecycle events) whose Kafka keys, headers, run ids, dataset and eval ids vary (Unicode,
control characters, 10 KB, None, non-UTF-8, `|`):
- no input and no tick raises, and the worker counts no error of its own;
- every bad message is dead-lettered exactly once, with a reason naming the field;
- the good message after a bad one is processed (its step's smoothed point is sent, at
  the latest when the step's wait for its other ranks is over);
- the states reloaded after the restart equal the states before it.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.field_rules import text_problem
from areal_metrics.streams.state import codec
from areal_metrics.producers.contract.events import EvalEvent, RunEvent, StepEvent, parse_event
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.streams.shell.app import StreamCore
from areal_metrics.streams.core.config import RunConfig, StreamsConfig
from areal_metrics.streams.core.processor import RunState
from areal_metrics.streams.state.state_store import stored_state
from tests.feed_support import RecordingTransport, inputs
from areal_metrics.streams.core.voting import NodeResult, RoundKey, VoteState, add_result

TOPICS = Topics("hostile.")
CFG = RunConfig(window=3, vote_timeout_s=5.0, stall_seconds=0, step_wait_s=3.0, lr_eval_threshold=0.5,
                no_improvement_rounds=2)

KEYS = st.one_of(
    st.none(),
    st.sampled_from([b"", "ключ".encode(), "café".encode(), b"\x00\x1b[31m\n\r", b"\xff\xfe\xfd", b"x" * 10_240]),
    st.binary(max_size=64),
    st.text(max_size=32).map(str.encode),
)
HEADERS = st.lists(
    st.tuples(st.text(max_size=16), st.one_of(st.none(), st.binary(max_size=32))), max_size=3
)
GOOD_RUN_IDS = st.from_regex(r"[A-Za-z0-9._:-]{1,24}", fullmatch=True)
BAD_RUN_IDS = st.sampled_from(["ключ", "a|b", "run id", "", "x" * 129, "tab\there", "nul\x00"])
NAMES = st.one_of(
    st.sampled_from(["math|500", "a|b|c|d", "|", "\\|", "ключ", "café", "e\n1", "x" * 128]),
    st.text(min_size=1, max_size=40).filter(lambda s: text_problem(s) is None),  # a good event's text is storable
)


@dataclass
class Msg:
    topic: str
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    good: bool
    field: str | None = None  # for a bad message: the field its reason must name


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, dict[str, Any]]] = []

    async def send(self, topic: str, key: bytes, value: bytes) -> Any:
        parse_event(value, expected=TOPICS.event_type(topic))  # every output is a contract record
        self.sent.append((topic, key, json.loads(value)))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    def on(self, topic: str) -> list[dict[str, Any]]:
        return [v for t, _, v in self.sent if t == topic]


def core(table: dict[bytes, bytes], rec: Recorder, clock: list[float]) -> StreamCore:
    return StreamCore(topics=TOPICS, config=StreamsConfig(defaults=CFG), table=table, send=rec.send,
                      clock=lambda: clock[0])


@st.composite
def good_step(draw: Any, run_id: str, n: int) -> bytes:
    rank = draw(st.integers(0, 1))
    reward = draw(st.one_of(st.floats(-1, 1), st.none()))
    return StepEvent(run_id=run_id, node=f"n{rank}", rank=rank, step=n, epoch=draw(st.sampled_from([0, 0.5])),
                     reward=reward, world_size=draw(st.sampled_from([None, rank + 1, 2])),  # rank < world_size
                     n_samples=draw(st.one_of(st.none(), st.integers(0, 64))),
                     non_finite=() if reward is not None else draw(st.sampled_from([("reward",), ("reward", "ключ|x")])),
                     ts=1.0 + n, event_id=f"{run_id}-{n}").to_json()


@st.composite
def good_run(draw: Any, run_id: str) -> bytes:
    rank = draw(st.integers(0, 2))
    return RunEvent(run_id=run_id, node=f"n{rank}", rank=rank, status=draw(st.sampled_from(
        ["running", "finished", "failed", "killed"])), world_size=draw(st.integers(rank + 1, 3)),
        config={"eval_interval_steps": draw(st.integers(1, 100)), draw(NAMES): draw(NAMES)},
        tags=tuple(draw(st.lists(NAMES, max_size=2))), ts=1.0, event_id=f"{run_id}-run-{draw(st.integers(0, 99))}",
    ).to_json()


@st.composite
def bad_run(draw: Any, run_id: str) -> tuple[bytes, str | None]:
    base = {"type": "run", "schema": 1, "run_id": run_id, "node": "n0", "rank": 0, "ts": 1.0, "event_id": "bad",
            "status": "running"}
    field, value = draw(st.sampled_from([
        ("status", "done"), ("status", None), ("world_size", 0), ("config", [1, 2]), ("config", {"a": {"b": 1e999}}),
        ("tags", ["x"] * 300), ("attempt", -1), ("run_id", "a|b"), ("type", "step"), ("exit_code", 2**40),
    ]))
    if value is None:
        return json.dumps({k: v for k, v in base.items() if k != field}).encode(), field
    raw = json.dumps({**base, field: value}).replace("Infinity", "1e999")
    return raw.encode(), field if field != "type" else "event.type"


@st.composite
def good_eval(draw: Any, run_id: str, n: int) -> bytes:
    return EvalEvent(run_id=run_id, node=draw(st.sampled_from(["n0", "n1", "n2"])), eval_id=draw(NAMES)[:256],
                     step=n, dataset=draw(NAMES)[:128], stage=draw(st.sampled_from(["quick", "full"])),
                     accuracy=draw(st.floats(0, 1)), replicas=draw(st.integers(1, 3)), ts=2.0,
                     event_id=f"{run_id}-e{n}-{draw(st.integers(0, 9))}").to_json()


@st.composite
def bad_message(draw: Any, run_id: str) -> tuple[bytes | None, str | None]:
    kind = draw(st.sampled_from(["run_id", "json", "utf8", "null", "reward", "step"]))
    base = {"type": "step", "schema": 1, "run_id": run_id, "node": "n0", "rank": 0, "ts": 1.0,
            "event_id": "bad", "step": 1, "epoch": 0}
    if kind == "run_id":
        return json.dumps({**base, "run_id": draw(BAD_RUN_IDS)}).encode(), "run_id"
    if kind == "json":
        return b'{"type": "step", ', None
    if kind == "utf8":
        return b'{"type":"step","node":"\xff"}', "UTF-8"
    if kind == "null":
        return None, "empty message"
    if kind == "reward":
        return json.dumps({**base, "reward": "NaN"}).encode(), "reward"
    return json.dumps({**base, "step": -1}).encode(), "step"


@st.composite
def scenario(draw: Any) -> list[Msg]:
    """Good steps (ascending, one per message) with bad and eval messages between them."""
    runs = draw(st.lists(GOOD_RUN_IDS, min_size=1, max_size=3, unique=True))
    msgs: list[Msg] = []
    for n in range(draw(st.integers(2, 12))):
        run_id = draw(st.sampled_from(runs))
        if draw(st.booleans()):
            value, fld = draw(bad_message(run_id))
            msgs.append(Msg(TOPICS.steps, draw(KEYS), value, draw(HEADERS), False, fld))
        if draw(st.booleans()):
            msgs.append(Msg(TOPICS.evals, draw(KEYS), draw(good_eval(run_id, n)), draw(HEADERS), True))
        if draw(st.integers(0, 3)) == 0:
            value, fld = draw(bad_run(run_id))
            msgs.append(Msg(TOPICS.runs, draw(KEYS), value, draw(HEADERS), False, fld))
        if draw(st.integers(0, 3)) == 0:
            msgs.append(Msg(TOPICS.runs, draw(KEYS), draw(good_run(run_id)), draw(HEADERS), True))
        msgs.append(Msg(TOPICS.steps, draw(KEYS), draw(good_step(run_id, n)), draw(HEADERS), True))
    return msgs


def feed(c: StreamCore, msgs: list[tuple[int, Msg]], clock: list[float], settle: bool = False) -> None:
    async def go() -> None:
        for offset, m in msgs:
            clock[0] += 1.0
            await c.on_input(m.topic, 0, offset, m.key, m.value, 1.0)
            await c.on_tick(0)
        if settle:  # past every wait: the steps whose other rank never came are emitted
            clock[0] += 1000.0
            await c.on_tick(0)

    asyncio.run(go())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(), st.data())
def test_hostile_input_across_a_restart(msgs: list[Msg], data: st.DataObject) -> None:
    table: dict[bytes, bytes] = {}
    rec, clock = Recorder(), [1000.0]
    numbered = list(enumerate(msgs))
    cut = data.draw(st.integers(0, len(numbered)))
    first = core(table, rec, clock)
    feed(first, numbered[:cut], clock)
    before = dict(first.cache)
    second = core(table, rec, clock)  # the restart: nothing cached, every state from its bytes
    assert {r: second.load(r, 0) for r in before} == before
    feed(second, numbered[cut:], clock, settle=True)

    assert first.stats["errors"] == 0 and second.stats["errors"] == 0
    assert first.stats.get("bad_states", 0) == 0 and second.stats.get("bad_states", 0) == 0
    bad = [m for m in msgs if not m.good]
    dead = rec.on(TOPICS.deadletter)
    assert len(dead) == len(bad)
    for m, d in zip(bad, dead):
        assert d["source_topic"] == m.topic and d["reason"]
        if m.field is not None:
            assert m.field in d["reason"], (m.value, d["reason"])
    smoothed = {(s["run_id"], s["step"]) for s in rec.on(TOPICS.smoothed)}
    for m in msgs:
        if m.good and m.topic == TOPICS.steps:
            ev = parse_event(m.value)  # type: ignore[arg-type]
            assert ((ev.run_id, ev.step) in smoothed) == (ev.reward is not None)
    for state in second.cache.values():
        assert state.ranks.pending == {}  # nothing waits for ever


@settings(max_examples=40, deadline=None)
@given(eval_id=NAMES, dataset=NAMES, stage=st.sampled_from(["quick", "full"]))
def test_a_round_with_separators_survives_a_restart_and_collects_both_votes(
    eval_id: str, dataset: str, stage: str
) -> None:
    """The issue-13 crash: `|` in dataset/eval_id used to corrupt the reloaded round key."""
    key = RoundKey("run-1", eval_id, dataset, stage)
    state, out = add_result(VoteState(), key, 10, 2, NodeResult("n0", True, 0.5), 0.0, CFG)
    assert out.consensus is None
    stored = codec.dumps(RunState("run-1", votes=state))
    reloaded = codec.loads(RunState, stored)
    assert reloaded.votes == state
    _, out = add_result(reloaded.votes, key, 10, 2, NodeResult("n1", True, 0.5), 1.0, CFG)
    assert out.consensus is not None and out.consensus.votes == 2 and out.consensus.key == key


def test_a_stored_state_that_does_not_decode_is_dead_lettered_once_and_the_run_goes_on() -> None:
    table = {b"run-1": b'{"run_id": "run-1", "votes": {"open_rounds": [["run-1|e|d|quick", {}]]}}',
             b"run-2": b"\xff not json"}
    rec, clock = Recorder(), [1000.0]
    c = core(table, rec, clock)

    async def go() -> None:
        await c.on_tick(0)  # must not raise
        await c.on_tick(0)
        await c.on_input(TOPICS.steps, 0, 0, b"run-1",
                         StepEvent(run_id="run-1", node="n0", step=0, epoch=0, reward=0.5, ts=1.0).to_json())

    asyncio.run(go())
    dead = rec.on(TOPICS.deadletter)
    assert sorted(d["run_id"] for d in dead) == ["run-1", "run-2"]
    assert all("stream state of run" in d["reason"] for d in dead)
    assert "open_rounds" in next(d["reason"] for d in dead if d["run_id"] == "run-1")
    assert [s["step"] for s in rec.on(TOPICS.smoothed)] == [0]
    assert stored_state(table, "run-1").smoothing.max_step == 0
    assert stored_state(table, "run-2") == RunState("run-2", partition=0)
    assert b"run-1" not in table and b"run-2" not in table  # the bad records are replaced
    assert c.stats["errors"] == 0


def test_bad_input_through_the_faust_agent_with_hostile_keys_and_headers(tmp_path: Any) -> None:
    """The same through Faust's real agent and table (test_context), headers included."""
    from areal_metrics.streams.shell.app import build_worker

    rec = Recorder()
    worker = build_worker(bootstrap="127.0.0.1:9", topics=TOPICS, datadir=tmp_path,
                          config=StreamsConfig(defaults=CFG), transport=RecordingTransport(rec.send),
                          clock=lambda: 1000.0)
    worker.app.finalize()
    worker.app.flow_control.resume()
    keys = [None, "ключ".encode(), "café".encode(), b"\x00\x07", b"k" * 10_240, b"\xff\xfe"]
    headers = [None, {"ключ": b"\xff"}, [("x", None)], {"": b"k" * 1000}, [("\x00", b"")], {"a|b": b"c"}]

    async def go() -> None:
        async with inputs(worker, TOPICS.steps) as agent:
            for i, (key, hdrs) in enumerate(zip(keys, headers)):
                await agent.put(b"\xff{not json", key=key, headers=hdrs)
                good = StepEvent(run_id="r|ok".replace("|", "-"), node="n0", step=i, epoch=0, reward=0.1 * i,
                                 ts=1.0, event_id=f"s{i}").to_json()
                await agent.put(good, key=key, headers=hdrs)
            await worker.settled()

        async with inputs(worker, TOPICS.runs) as agent:
            for i, (key, hdrs) in enumerate(zip(keys, headers)):
                await agent.put(b'{"type":"run","run_id":"r-ok","event_id":"b","ts":1,"status":"running",'
                                b'"world_size":"two"}', key=key, headers=hdrs)
                good_run = RunEvent(run_id="r-ok", node="n0", rank=i, status="finished", world_size=len(keys),
                                    ts=1.0, event_id=f"run{i}").to_json()
                await agent.put(good_run, key=key, headers=hdrs)
            await worker.settled()

    asyncio.run(go())
    dead = rec.on(TOPICS.deadletter)
    assert len(dead) == 2 * len(keys)
    assert all(d["reason"] == "runs.world_size: not an integer (str)" for d in dead if d["source_topic"] == TOPICS.runs)
    assert [s["step"] for s in rec.on(TOPICS.smoothed)] == list(range(len(keys)))
    assert worker.core.stats["errors"] == 0 and worker.core.stats["runs"] == len(keys)
    assert stored_state(worker.core.table, "r-ok").lifecycle.ended


def test_stored_states_whose_new_fields_do_not_decode_are_dead_lettered_once() -> None:
    good = json.loads(codec.dumps(RunState("x")))
    corrupt = {
        "run-3": ("ranks", {"pending": [["0|5", {"world_size": 2, "opened_at": 1.0, "ts": 1.0}]]}, "ranks.pending"),
        "run-4": ("lifecycle", {"done_ranks": ["x"]}, "lifecycle.done_ranks"),
        "run-5": ("eval_loop", {"last": [1]}, "eval_loop.last"),
        "run-6": ("non_finite", {"fields": 7}, "non_finite.fields"),
        "run-7": ("smoothing", {"starts": [[1, "a"]]}, "smoothing.starts"),
    }
    table = {run.encode(): json.dumps({**good, "run_id": run, part: value}).encode()
             for run, (part, value, _) in corrupt.items()}
    rec, clock = Recorder(), [1000.0]
    c = core(table, rec, clock)

    async def go() -> None:
        await c.on_tick(0)
        await c.on_tick(0)
        for run in corrupt:
            await c.on_input(TOPICS.runs, 0, 0, run.encode(),
                             RunEvent(run_id=run, node="n0", status="running", ts=1.0).to_json())

    asyncio.run(go())
    dead = rec.on(TOPICS.deadletter)
    assert sorted(d["run_id"] for d in dead) == sorted(corrupt)
    for d in dead:
        assert corrupt[d["run_id"]][2] in d["reason"], d["reason"]
    assert c.stats["errors"] == 0


def test_a_step_waiting_for_its_other_rank_survives_a_restart() -> None:
    table: dict[bytes, bytes] = {}
    rec, clock = Recorder(), [1000.0]

    def step(rank: int, reward: float) -> bytes:
        return StepEvent(run_id="run-w", node=f"n{rank}", rank=rank, step=4, epoch=0, reward=reward, world_size=2,
                         n_samples=1 + rank, ts=1.0, event_id=f"w{rank}").to_json()

    asyncio.run(core(table, rec, clock).on_input(TOPICS.steps, 0, 0, b"run-w", step(0, 0.0)))
    assert rec.on(TOPICS.smoothed) == [] and stored_state(table, "run-w").ranks.pending
    asyncio.run(core(table, rec, clock).on_input(TOPICS.steps, 0, 1, b"run-w", step(1, 0.9)))  # after the restart
    assert [s["reward"] for s in rec.on(TOPICS.smoothed)] == [0.6]  # (0 * 1 + 0.9 * 2) / 3


OLDER_WORKER_STATE = (  # what the worker before rank aggregation wrote (no ranks, lifecycle, eval loop, ...)
    b'{"run_id":"r","partition":null,"smoothing":{"points":[{"step":1,"reward":0.5,"window":2,"sliding_avg":0.25,'
    b'"ema":0.05,"slope":0.5,"source_id":"e1","attempt":0},{"step":2,"reward":1.0,"window":2,"sliding_avg":0.75,'
    b'"ema":0.14500000000000002,"slope":0.5,"source_id":"e2","attempt":0}],"ema_base":0.0,"max_step":2},'
    b'"trigger":{"mode":"fast","interval":25,"last_change_step":1,"baseline":0.75,"baseline_step":2},'
    b'"reward_alert":{"in_breach":false,"last_fired_step":null,"armed":false},"throughput":{"history":[],'
    b'"breach":{"in_breach":false,"last_fired_step":null,"armed":true}},"stall":{"last_step_at":2.0,"last_step":2,'
    b'"stalled":false},"votes":{"open_rounds":[],"closed":[],"last_good":[]},"invalid":[]}'
)


def test_a_state_written_by_the_older_worker_still_loads_and_goes_on() -> None:
    table, rec, clock = {b"r": OLDER_WORKER_STATE}, Recorder(), [1000.0]
    c = core(table, rec, clock)
    asyncio.run(c.on_input(TOPICS.steps, 0, 0, b"r", StepEvent(run_id="r", node="n0", step=3, epoch=0, reward=1.5,
                                                               ts=4.0, event_id="e3").to_json()))
    assert c.stats.get("bad_states", 0) == 0 and rec.on(TOPICS.deadletter) == []
    assert [(s["step"], s["sliding_avg"]) for s in rec.on(TOPICS.smoothed)] == [(3, 1.0)]
    state = stored_state(table, "r")
    assert b"r" not in table  # replaced by the records of the new layout
    assert state.trigger.interval == 25 and state.lifecycle.attempt == 0 and state.ranks.pending == {}
