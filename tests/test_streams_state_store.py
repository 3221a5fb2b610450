"""The worker's state as records (areal_metrics.streams.state.state_store) and batches (areal_metrics.streams.shell.batch), no broker.

- a state saved and loaded by a new store (a restart) is the same state;
- a batch of steps rewrites one record per run; closing a round with 2,048 closed rounds
  remembered writes a handful, not 2,048;
- a save cut short after any of its writes (a crash), then the batch read again, gives the
  same state and only copies of the events the batch gave;
- processing messages in batches gives the outputs and states one-by-one processing gives.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.events import EvalEvent, RunEvent, StepEvent
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.streams.state import codec
from areal_metrics.streams.shell.batch import Input, StreamCore
from areal_metrics.streams.core.config import RunConfig, StreamsConfig
from areal_metrics.streams.core.processor import RunState
from areal_metrics.streams.state.state_store import StateStore, record_key
from areal_metrics.streams.core.voting import CLOSED_ROUNDS_KEPT, NodeResult, RoundKey, add_result
from tests.support import replay_changelog

TOPICS = Topics("store.")
CFG = RunConfig(window=3, vote_timeout_s=5.0, stall_seconds=0, step_wait_s=3.0, lr_eval_threshold=0.5)


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, dict[str, Any]]] = []

    async def send(self, topic: str, key: bytes, value: bytes) -> Any:
        self.sent.append((topic, key, json.loads(value)))
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


class LoggedTable(dict):
    """A dict that logs every put and delete, in order."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.log: list[tuple[str, bytes, bytes | None]] = []

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.log.append(("put", key, value))
        super().__setitem__(key, value)

    def pop(self, key: bytes, *default: Any) -> Any:
        if key in self:
            self.log.append(("delete", key, None))
        return super().pop(key, *default)


def step(run: str, n: int, rank: int = 0, world: int | None = None, reward: float = 0.5) -> bytes:
    return StepEvent(run_id=run, node=f"n{rank}", rank=rank, step=n, epoch=0, reward=reward, world_size=world,
                     throughput=1000.0 + n, ts=1.0 + n, event_id=f"{run}-{rank}-{n}").to_json()


def result(run: str, eval_id: str, node: str, accuracy: float, replicas: int = 2, stage: str = "full") -> bytes:
    return EvalEvent(run_id=run, node=node, eval_id=eval_id, step=1, dataset="math|500", stage=stage,
                     accuracy=accuracy, replicas=replicas, ts=2.0, event_id=f"{run}-{eval_id}-{node}").to_json()


def feed(core: StreamCore, batches: list[list[tuple[str, bytes]]], tick: bool = False) -> None:
    async def go() -> None:
        offset = 0
        for batch in batches:
            msgs = []
            for topic, value in batch:
                msgs.append(Input(topic, 0, offset, None, value, 1.0))
                offset += 1
            await core.on_batch(msgs)
            if tick:
                await core.on_tick(0)

    asyncio.run(go())


def busy_state(core: StreamCore) -> None:
    """A run with every kind of record: steps waiting for ranks, open and closed rounds, a last
    good consensus, a dead letter's memory."""
    feed(core, [
        [(TOPICS.steps, step("r", n)) for n in range(5)],
        [(TOPICS.steps, step("r", 5, rank=0, world=2)), (TOPICS.steps, step("r", 6, rank=1, world=2))],
        [(TOPICS.evals, result("r", "e1", "a", 0.5)), (TOPICS.evals, result("r", "e1", "b", 0.5))],
        [(TOPICS.evals, result("r", "e2", "a", 0.7, replicas=3))],
        [(TOPICS.steps, b'{"type": "step", "run_id": "r", "step": -1}'), (TOPICS.runs, RunEvent(run_id="r", node="n0", status="running",
                                                               config={"eval_interval_steps": 7}, ts=1.0).to_json())],
    ])


def make_core(table: Any) -> tuple[StreamCore, Recorder]:
    rec = Recorder()
    return StreamCore(topics=TOPICS, config=StreamsConfig(defaults=CFG), table=table, send=rec.send,
                      clock=lambda: 1000.0), rec


def test_a_saved_state_loads_back_the_same_in_a_new_store() -> None:
    table: dict[bytes, bytes] = {}
    core, _ = make_core(table)
    busy_state(core)
    state = core.cache["r"]
    assert state.ranks.pending and state.votes.open_rounds and state.votes.closed and state.votes.last_good
    assert state.invalid and state.trigger.base_interval == 7
    assert StateStore(table).load("r") == state
    kinds = sorted(json.loads(k)[1] for k in table)
    assert kinds == ["closed", "pending", "pending", "round", "run"]  # head, 2 waiting steps, 2 rounds


def test_a_batch_of_steps_rewrites_one_record_per_run() -> None:
    table = LoggedTable()
    core, _ = make_core(table)
    busy_state(core)
    table.log.clear()
    feed(core, [[(TOPICS.steps, step(run, n)) for n in range(10, 30) for run in ("r", "q")]])
    assert sorted(key for _, key, _ in table.log) == [record_key("q", "run"), record_key("r", "run")]


def test_closing_a_round_beside_2048_closed_ones_writes_a_handful_of_records() -> None:
    table = LoggedTable()
    core, _ = make_core(table)
    feed(core, [[(TOPICS.evals, result("r", f"e{i}", "a", 0.5, replicas=1)) for i in range(CLOSED_ROUNDS_KEPT)]])
    assert len(core.cache["r"].votes.closed) == CLOSED_ROUNDS_KEPT
    table.log.clear()
    feed(core, [[(TOPICS.evals, result("r", "late", "a", 0.5, replicas=2))],
                [(TOPICS.evals, result("r", "late", "b", 0.5, replicas=2))]])
    ops = [(op, json.loads(key)[1]) for op, key, _ in table.log]
    # the round opens (round + head), then closes: its number, the head, its tombstone, the oldest forgotten
    assert ops == [("put", "round"), ("put", "run"),
                   ("put", "closed"), ("put", "run"), ("delete", "round"), ("delete", "closed")]
    state = StateStore(dict(table)).load("r")
    assert state == core.cache["r"] and state.votes.closed[-1].eval_id == "late"
    assert state.votes.closed[0].eval_id == "e1"  # e0 forgotten: the oldest


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_a_save_cut_short_and_the_batch_read_again_give_the_same_state_and_events(data: st.DataObject) -> None:
    table = LoggedTable()
    core, rec = make_core(table)
    busy_state(core)
    before = dict(table)
    table.log.clear()
    rec.sent.clear()
    batch = data.draw(st.lists(st.sampled_from([
        (TOPICS.evals, result("r", "e2", "b", 0.7, replicas=3)),  # closes e2: round deleted, closed added
        (TOPICS.evals, result("r", "e3", "a", 0.1, replicas=2)),  # opens e3
        (TOPICS.steps, step("r", 5, rank=1, world=2)),  # completes step 5
        (TOPICS.steps, step("r", 7, rank=0, world=2)),  # a new step waits
        (TOPICS.steps, step("r", 6, rank=2, world=3)),  # step 6 waits on (rewritten)
        (TOPICS.steps, step("r", 40)),
    ]), min_size=1, max_size=5))
    feed(core, [batch])
    new_state, first = core.cache["r"], {v["event_id"]: v for _, _, v in rec.sent}
    writes = list(table.log)
    for cut in range(len(writes) + 1):
        crashed = dict(before)
        for op, key, value in writes[:cut]:
            if op == "put":
                crashed[key] = value
            else:
                crashed.pop(key, None)
        again, rec2 = make_core(crashed)
        feed(again, [batch])  # the offsets were not committed: the batch comes again
        assert again.cache["r"] == new_state, cut
        assert StateStore(crashed).load("r") == new_state, cut
        assert all(first.get(v["event_id"]) == v for _, _, v in rec2.sent), cut
        if cut == 0:
            assert {v["event_id"] for _, _, v in rec2.sent} == set(first)


def test_a_state_of_the_older_layout_loads_and_is_replaced_at_the_next_save() -> None:
    table: dict[bytes, bytes] = {}
    core, _ = make_core(table)
    busy_state(core)
    old_layout = {b"r": codec.dumps(core.cache["r"])}
    core2, _ = make_core(old_layout)
    assert core2.load("r", 0) == core.cache["r"]
    feed(core2, [[(TOPICS.steps, step("r", 50))]])
    assert b"r" not in old_layout and StateStore(old_layout).load("r") == core2.cache["r"]


def test_a_run_whose_head_does_not_decode_starts_over_and_its_leftovers_go() -> None:
    table: dict[bytes, bytes] = {}
    core, _ = make_core(table)
    busy_state(core)
    table[record_key("r", "run")] = b'{"smoothing": {"points": "no"}}'
    core2, rec = make_core(table)
    feed(core2, [[(TOPICS.steps, step("r", 0))]])
    dead = [v for t, _, v in rec.sent if t == TOPICS.deadletter]
    assert len(dead) == 1 and "$.smoothing.points" in dead[0]["reason"]
    assert core2.stats["bad_states"] == 1 and core2.stats["errors"] == 0
    assert sorted(json.loads(k)[1] for k in table) == ["run"]  # the old round records are gone
    assert StateStore(table).load("r").smoothing.max_step == 0


def test_round_keys_with_separators_stay_apart_in_record_keys() -> None:
    cfg = RunConfig()
    votes, _ = add_result(RunState("r").votes, RoundKey("r", "a|b", "c", "full"), 1, 2, NodeResult("n", True, 0.5),
                          0.0, cfg)
    votes, _ = add_result(votes, RoundKey("r", "a", "b|c", "full"), 1, 2, NodeResult("n", True, 0.5), 0.0, cfg)
    table: dict[bytes, bytes] = {}
    StateStore(table).save(RunState("r", partition=0, votes=votes))
    assert StateStore(table).load("r").votes == votes


# ------------------------------------------------------------------ batches = one by one

RUNS = ("r1", "r2")


@st.composite
def message(draw: Any) -> tuple[str, bytes]:
    run = draw(st.sampled_from(RUNS))
    kind = draw(st.sampled_from(["step", "step", "step", "ranked", "eval", "bad", "run"]))
    n = draw(st.integers(0, 12))
    if kind == "step":
        return TOPICS.steps, step(run, n, reward=draw(st.floats(0, 1)))
    if kind == "ranked":
        return TOPICS.steps, step(run, n, rank=draw(st.integers(0, 2)), world=3, reward=draw(st.floats(0, 1)))
    if kind == "eval":
        return TOPICS.evals, result(run, f"e{n % 3}", draw(st.sampled_from("abc")), draw(st.floats(0, 1)), 3,
                                    draw(st.sampled_from(["quick", "full"])))
    if kind == "run":
        return TOPICS.runs, RunEvent(run_id=run, node="n0", status=draw(st.sampled_from(["running", "finished"])),
                                     attempt=draw(st.integers(0, 1)), ts=1.0, event_id=f"{run}-run-{n}").to_json()
    return TOPICS.steps, json.dumps({"type": "step", "run_id": run, "step": -n}).encode()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(message(), min_size=1, max_size=40), st.data())
def test_batches_give_what_one_message_at_a_time_gives(msgs: list[tuple[str, bytes]], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(msgs) - 1)), max_size=5)))
    batches = [msgs[a:b] for a, b in zip([0, *cuts], [*cuts, len(msgs)]) if a < b]
    one_table: dict[bytes, bytes] = {}
    one, one_rec = make_core(one_table)
    feed(one, [[m] for m in msgs], tick=False)
    many_table: dict[bytes, bytes] = {}
    many, many_rec = make_core(many_table)
    feed(many, batches, tick=False)
    for run in RUNS:
        per_run = [[(t, v) for t, _, v in rec.sent if v["run_id"] == run] for rec in (one_rec, many_rec)]
        assert per_run[0] == per_run[1], run
        assert StateStore(one_table).load(run) == StateStore(many_table).load(run)
    assert one.stats["errors"] == many.stats["errors"] == 0


class FaustLikeTable:
    """What the store uses of Faust's table: `data`, and `send_changelog` (recorded)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.changelog: list[tuple[int, bytes, bytes | None]] = []

    def send_changelog(self, partition: int, key: bytes, value: bytes | None, **kw: Any) -> None:
        self.changelog.append((partition, key, value))


def test_changelog_records_sent_directly_are_the_tables_own_in_the_same_order() -> None:
    via_table = FaustLikeTable()
    core, _ = make_core(via_table)
    busy_state(core)
    completes = [[(TOPICS.steps, step("r", 5, rank=1, world=2))]]  # its waiting record goes: a tombstone
    feed(core, completes)
    direct_table, sent = FaustLikeTable(), []

    async def changelog(records: list[tuple[int, bytes, bytes | None]]) -> None:
        sent.extend(records)

    rec = Recorder()
    direct = StreamCore(topics=TOPICS, config=StreamsConfig(defaults=CFG), table=direct_table, send=rec.send,
                        clock=lambda: 1000.0, changelog=changelog)
    busy_state(direct)
    feed(direct, completes)
    assert direct_table.changelog == []  # none through the table's buffer
    assert sent == via_table.changelog and any(v is None for _, _, v in sent)  # tombstones too
    assert direct.store.io.take() == []  # every record left at the end of its batch
    replayed = replay_changelog(sent)  # what a worker recovering from the changelog reads
    assert replayed == direct_table.data and StateStore(replayed).load("r") == direct.cache["r"]
